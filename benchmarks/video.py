"""Video benchmarks on the default random-weight Qwen2.5-VL (same weights for us and HF).

Clips: made here with PyAV (``make_clip``), H.264 at 30 fps, 3 s and 60 s, every frame
different (a hue that drifts, a moving gradient, a bright square that travels), keyframe
every ``GOP`` frames with the encoder's B-frames, written to a temporary folder: 320x240
with ``--quick``, 640x480 otherwise.

``run``, per clip (prompt: one video item at fps 2 with a small per-frame
``min_pixels``/``max_pixels``, and a question):

- TTFT from the chat messages (``LLM.chat``, one token): PyAV decode with seeking, frame
  sampling, resize + patchify, vision tower, prefill. Our encoder cache is cleared and prefix
  caching is off, so every run decodes the file and runs the tower and the full prefill.
- TTFT from the processed frames (``llm.generate`` on ``llm.engine.process_prompt``'s
  prompt) against HF ``Qwen2_5_VLForConditionalGeneration.generate(max_new_tokens=1)`` on the
  same ``input_ids``, ``pixel_values_videos``, ``video_grid_thw`` and ``second_per_grid_ts``
  (as ``tests/helpers.hf_inputs``): speed-up = HF TTFT / ours.
- decode tokens/s over ``n`` greedy tokens, ours (stream) vs HF ``generate`` (streamer clock),
  ``(n - 1) / (end - first token)``; ratio ours / HF, and the greedy tokens compared.

``peak_rss``: the peak resident memory of ``mm_token_pipeline.load_video`` on each clip, in a
fresh child process per clip and sampling (so no two share a high-water mark): ``VmHWM`` of
``/proc/self/status`` after the load minus ``VmRSS`` before it (the high-water mark is reset
first through ``/proc/self/clear_refs`` where the kernel allows). Sampled twice: at fps 2 (as
the prompt: the kept frames grow with the duration, 6 vs 120) and at a fixed ``nframes`` (the
same output for both clips, so any growth would be the decoder's). Decoding seeks and keeps
only the sampled frames, so the peak beyond the kept frames must not grow with the clip.

    python benchmarks/video.py --quick        # alone, ~1-2 min on 2 cores
    python scripts/bench.py --vlm --quick     # with the image TTFT section

All times are seconds (tables show milliseconds), memory in bytes (tables show MB = 1e6 B).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: benchmarks/ lives in the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    best_of,
    compare_tokens,
    dtype_name,
    fmt,
    log,
    markdown_table,
    match_str,
    now,
    section,
    vlm_model_path,
)
from benchmarks.text import _Clock  # noqa: E402  HF streamer recording when each token arrives

QUESTION = "What happens in this video?"
FPS = 30  # source frame rate of the clips
GOP = 30  # keyframe interval (frames): one keyframe a second, as a streaming encoder sets
CLIP_SECONDS = (3, 60)
SAMPLE_FPS = 2.0  # the prompt's frames per second
FIXED_NFRAMES = 8  # peak RSS at the same output size for both clips
PAD_ID, VIDEO_PAD_ID = 151643, 151656  # Qwen's <|endoftext|>, <|video_pad|>
ROOT = Path(__file__).resolve().parent.parent


# ---- clips -------------------------------------------------------------------------------------
def clip_frame(i: int, width: int, height: int) -> np.ndarray:
    """Frame ``i`` of a synthetic clip: uint8 RGB ``[height, width, 3]``, different every frame
    (hue drifting with ``i``, a gradient moving 2 px a frame, a white square travelling 4 px a frame)."""
    x = np.arange(width, dtype=np.float32)[None, :]
    y = np.arange(height, dtype=np.float32)[:, None]
    phase = 2 * np.pi * i / 90.0
    r = 127.5 + 127.5 * np.sin(2 * np.pi * (x + 2 * i) / width + phase)
    g = 127.5 + 127.5 * np.sin(2 * np.pi * (y + i) / height - phase)
    b = np.broadcast_to(np.float32(127.5 + 127.5 * np.cos(phase)), (height, width))
    img = np.stack([np.broadcast_to(r, (height, width)), np.broadcast_to(g, (height, width)), b], axis=-1)
    img = img.astype(np.uint8)
    side = max(8, height // 8)
    sx = (4 * i) % max(1, width - side)
    sy = (height - side) // 2 + int((height // 4) * np.sin(i / 15.0))
    img[sy:sy + side, sx:sx + side] = 255
    return img


def make_clip(path: str | Path, seconds: float, *, width: int = 320, height: int = 240, fps: int = FPS,
              gop: int = GOP) -> Path:
    """Write an H.264 MP4 of ``round(seconds * fps)`` frames (``clip_frame``) with a keyframe
    every ``gop`` frames (scene-cut keyframes off, so the interval is exact; B-frames as x264's
    ``veryfast`` preset sets them).

    Returns:
        the path written.
    """
    import av

    path = Path(path)
    n = int(round(seconds * fps))
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"g": str(gop), "keyint_min": str(gop), "sc_threshold": "0", "preset": "veryfast",
                          "crf": "23"}
        for i in range(n):
            frame = av.VideoFrame.from_ndarray(clip_frame(i, width, height), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return path


# ---- TTFT and decode ---------------------------------------------------------------------------

def _messages(path: str, min_pixels: int, max_pixels: int) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "video", "video": path, "fps": SAMPLE_FPS, "min_pixels": min_pixels, "max_pixels": max_pixels},
        {"type": "text", "text": QUESTION}]}]


def _hf_kwargs(p) -> dict:
    """HF ``generate`` inputs of a one-video prompt (as ``tests/helpers.hf_inputs``)."""
    ids = torch.tensor([p.prompt_token_ids])
    v = p.videos[0]
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values_videos=v.pixel_values,
                video_grid_thw=torch.tensor([list(v.grid_thw)]), second_per_grid_ts=torch.tensor([v.second_per_grid_t]),
                mm_token_type_ids=2 * (ids == VIDEO_PAD_ID).int())  # transformers 5: 0 text, 2 video


def _clip_ttft(llm, hf, path: str, pix: tuple[int, int], n: int, repeats: int) -> dict:
    from atlas_vlm import SamplingParams

    runner = llm.engine.runner
    msgs = _messages(path, *pix)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t_pre, p = best_of(lambda: llm.engine.process_prompt({"messages": msgs}), repeats)
    v = p.videos[0]
    kwargs = _hf_kwargs(p)

    def ours_e2e():  # from the chat messages: decode, sample, resize, patchify, tower, prefill
        llm.engine.reset_mm_cache()
        return llm.chat(msgs, one, use_tqdm=False)[0].token_ids

    def ours():  # from the processed frames
        llm.engine.reset_mm_cache()
        return llm.generate(p, one, use_tqdm=False)[0].token_ids

    def hf_ttft():
        with torch.inference_mode():
            o = hf.generate(**kwargs, max_new_tokens=1, do_sample=False, temperature=None, top_p=None, top_k=None,
                            pad_token_id=PAD_ID)
        return o[0, kwargs["input_ids"].shape[1]:].tolist()

    def ours_decode():
        llm.engine.reset_mm_cache()
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0, first, last = now(), None, None
        for out in llm.generate(p, params, stream=True, use_tqdm=False):
            if first is None and out.token_ids:
                first = now()
            last = out
        end = now()
        return {"ttft_s": first - t0, "decode_s": end - first, "tokens": list(last.token_ids)}

    def hf_decode():
        clock = _Clock()
        t0 = now()
        with torch.inference_mode():
            o = hf.generate(**kwargs, max_new_tokens=n, min_new_tokens=n, do_sample=False, temperature=None,
                            top_p=None, top_k=None, pad_token_id=PAD_ID, streamer=clock)
        end = now()
        first = clock.times[1]  # times[0]: the prompt
        return {"ttft_s": first - t0, "decode_s": end - first, "tokens": o[0, kwargs["input_ids"].shape[1]:].tolist()}

    def best_decode(fn):
        fn()  # warm-up
        return min((fn() for _ in range(repeats)), key=lambda r: r["decode_s"])

    log(f"{Path(path).name}: {len(v.frame_indices)} frames sampled, grid {v.grid_thw}, {v.num_tokens} video tokens, "
        f"prompt {len(p.prompt_token_ids)}")
    t_e2e, _ = best_of(ours_e2e, repeats)
    t_ours, tok_ours = best_of(ours, repeats)
    t_hf, tok_hf = best_of(hf_ttft, repeats)
    dec_ours, dec_hf = best_decode(ours_decode), best_decode(hf_decode)
    for r in (dec_ours, dec_hf):
        r["decode_tok_s"] = (n - 1) / r["decode_s"]
    return {
        "frames_sampled": len(v.frame_indices), "grid_thw": list(v.grid_thw), "resized_hw": list(v.resized_hw),
        "video_tokens": v.num_tokens, "prompt_tokens": len(p.prompt_token_ids),
        "ours_load_preprocess_s": t_pre, "ours_e2e_ttft_s": t_e2e, "ours_ttft_s": t_ours, "hf_ttft_s": t_hf,
        "ttft_speedup_hf_over_ours": t_hf / t_ours, "first_token_equal": tok_ours == tok_hf,
        "new_tokens": n, "ours_decode_tok_s": dec_ours["decode_tok_s"], "hf_decode_tok_s": dec_hf["decode_tok_s"],
        "decode_speedup_ours_over_hf": dec_ours["decode_tok_s"] / dec_hf["decode_tok_s"],
        "match_hf": compare_tokens([dec_ours["tokens"]], [dec_hf["tokens"]]),
    }


# ---- peak RSS of load_video --------------------------------------------------------------------
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _rss_child(path: str, fps: float | None, nframes: int | None) -> dict:
    """In a fresh process: the memory ``load_video`` takes. Bytes; see the module docstring."""
    import mm_token_pipeline.video_decode as vd
    from mm_token_pipeline import load_video

    vd._av()  # PyAV imported before the baseline
    try:  # reset VmHWM to the current RSS (Linux >= 4.0); otherwise the import peak may mask ours
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    rss0, hwm0 = _status_kb("VmRSS"), _status_kb("VmHWM")
    t0 = now()
    frames = load_video(path, fps=fps, nframes=nframes)
    seconds = now() - t0
    hwm = _status_kb("VmHWM")
    return {"hwm_reset": reset, "rss_before": rss0 * 1024, "hwm_before": hwm0 * 1024, "hwm_after": hwm * 1024,
            "peak_growth": (hwm - rss0) * 1024, "frames_bytes": int(frames.frames.nbytes),
            "frames_sampled": frames.num_frames, "frames_decoded": frames.frames_decoded,
            "total_frames": frames.total_frames, "load_s": seconds}


def measure_load_rss(path: str | Path, *, fps: float | None = None, nframes: int | None = None) -> dict:
    """``_rss_child`` in a fresh interpreter (its own high-water mark)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--rss-child", str(path)]
    cmd += ["--fps", str(fps)] if fps is not None else ["--nframes", str(nframes)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def peak_rss(clips: dict[int, Path]) -> dict:
    """Peak RSS growth of ``load_video`` per clip, at fps 2 and at a fixed nframes; the verdict."""
    section(f"Video decode peak RSS: load_video, one fresh process per clip and sampling "
            f"(fps {SAMPLE_FPS:g}, and nframes {FIXED_NFRAMES})")
    res, rows = {}, []
    for label, kw in ((f"fps {SAMPLE_FPS:g}", {"fps": SAMPLE_FPS}), (f"nframes {FIXED_NFRAMES}",
                                                                     {"nframes": FIXED_NFRAMES})):
        for seconds, path in clips.items():
            log(f"peak RSS: {seconds} s clip, {label}")
            r = measure_load_rss(path, **kw)
            r["beyond_frames"] = r["peak_growth"] - r["frames_bytes"]
            res[f"{seconds}s {label}"] = r
            h, w = _hw(path)
            rows.append([f"{seconds} s", label, r["total_frames"], r["frames_sampled"], r["frames_decoded"],
                         fmt(r["frames_bytes"] / 1e6, 1), fmt(r["peak_growth"] / 1e6, 1),
                         fmt(r["beyond_frames"] / 1e6, 1), fmt(r["total_frames"] * h * w * 3 / 1e6, 0),
                         fmt(1000 * r["load_s"], 0)])
    print(markdown_table(["clip", "sampling", "frames in file", "frames kept", "frames decoded", "kept frames MB",
                          "peak RSS growth MB", "peak beyond kept frames MB", "all frames decoded would be MB",
                          "load ms"], rows))
    short, long_ = min(clips), max(clips)
    fixed, rate = f"nframes {FIXED_NFRAMES}", f"fps {SAMPLE_FPS:g}"
    # grows with the clip: the long clip's peak beyond its kept frames exceeds the short one's by
    # more than 16 MB and 50% (allocator noise: a few MB either way). At a fixed nframes both keep
    # the same frames, so that is the decoder's own memory; at fps 2 the kept frames themselves
    # grow with the duration (capped by fps, FPS_MAX_FRAMES), and are not counted.
    grows, beyond = {}, {}
    for label in (rate, fixed):
        a, b = (res[f"{s}s {label}"]["beyond_frames"] for s in (short, long_))
        grows[label], beyond[label] = b - a > max(16e6, 0.5 * a), (a, b)
    ratio = res[f"{long_}s {fixed}"]["peak_growth"] / max(1, res[f"{short}s {fixed}"]["peak_growth"])
    print(f"\nsame output ({fixed}): peak RSS growth {long_} s / {short} s clip {ratio:.2f}x. Peak beyond the kept "
          f"frames grows with the clip's length: " + "; ".join(
              f"{k}: {'YES' if grows[k] else 'no'} ({beyond[k][0] / 1e6:.1f} -> {beyond[k][1] / 1e6:.1f} MB)"
              for k in grows))
    return {"clips": res, "grows_with_length": grows, "fixed_nframes_peak_ratio_long_over_short": ratio}


def _hw(path) -> tuple[int, int]:
    from mm_token_pipeline import probe_video

    p = probe_video(str(path))
    return p.height, p.width


# ---- section -----------------------------------------------------------------------------------
def run(quick: bool = False, dtype: torch.dtype = torch.float32, workdir: str | None = None) -> dict:
    """Video TTFT and decode tok/s ours vs HF on a 3 s and a 60 s clip, and load_video's peak RSS.

    Returns:
        ``{"clip_size", "clips": {seconds: {...}}, "peak_rss": {...}}`` (seconds, bytes, ratios).
    """
    from transformers import Qwen2_5_VLForConditionalGeneration

    from atlas_vlm import LLM

    width, height = (320, 240) if quick else (640, 480)
    tokens_per_frame = 12 if quick else 24  # max_pixels in merged 28x28 patches per frame
    pix = (4 * 28 * 28, tokens_per_frame * 28 * 28)
    n = 16 if quick else 32
    repeats = 1 if quick else 3
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        clips = {}
        for seconds in CLIP_SECONDS:
            t0 = now()
            clips[seconds] = make_clip(Path(tmp) / f"clip_{seconds}s.mp4", seconds, width=width, height=height)
            log(f"made {clips[seconds].name}: {width}x{height} H.264, {FPS} fps, gop {GOP}, "
                f"{clips[seconds].stat().st_size / 1e3:.0f} kB in {now() - t0:.1f} s")
        section(f"Video TTFT and decode: 1 video at fps {SAMPLE_FPS:g} ({width}x{height} H.264 {FPS} fps, gop {GOP}; "
                f"per frame max_pixels {tokens_per_frame}*28*28), random-weight Qwen2.5-VL {dtype_name(dtype)}, "
                f"{n} new tokens, best of {repeats}")
        folder = vlm_model_path()
        llm = LLM(folder, dtype=dtype_name(dtype), max_model_len=4096, max_num_batched_tokens=4096,
                  num_kvcache_blocks=512, enable_prefix_caching=False)
        hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()
        out = {"clip_size": [width, height], "fps": FPS, "gop": GOP, "sample_fps": SAMPLE_FPS,
               "min_max_pixels": list(pix), "clips": {}}
        rows = []
        for seconds, path in clips.items():
            r = _clip_ttft(llm, hf, str(path), pix, n, repeats)
            out["clips"][f"{seconds}s"] = r
            rows.append([f"{seconds} s", r["frames_sampled"], r["video_tokens"], fmt(r["ttft_speedup_hf_over_ours"]),
                         fmt(1000 * r["ours_ttft_s"], 1), fmt(1000 * r["hf_ttft_s"], 1),
                         fmt(1000 * r["ours_e2e_ttft_s"], 1), fmt(1000 * r["ours_load_preprocess_s"], 1),
                         fmt(r["decode_speedup_ours_over_hf"]), fmt(r["ours_decode_tok_s"], 1),
                         fmt(r["hf_decode_tok_s"], 1), match_str(r["match_hf"])])
        del llm, hf
        print(markdown_table(["clip", "frames", "video tokens", "TTFT speed-up (HF / ours)", "ours TTFT ms",
                              "HF TTFT ms", "ours TTFT ms from the chat messages", "of which decode + preprocess ms",
                              "decode speed-up (ours / HF)", "ours decode tok/s", "HF decode tok/s",
                              "greedy tokens = HF"], rows))
        out["peak_rss"] = peak_rss(clips)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="320x240 clips, 16 new tokens, best of 1")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--rss-child", metavar="CLIP", help=argparse.SUPPRESS)  # internal: one peak-RSS measurement
    p.add_argument("--fps", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--nframes", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_child:
        print(json.dumps(_rss_child(args.rss_child, args.fps, args.nframes)))
        return 0
    import logging

    from atlas_vlm import EngineConfig

    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = EngineConfig(model="-", dtype=args.dtype, device="cpu").torch_dtype()
    results = run(quick=args.quick, dtype=dtype)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
