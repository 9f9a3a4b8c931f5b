"""VLM benchmarks on the default random-weight Qwen2.5-VL (same weights for us and HF).

``run``: time to first token (TTFT) with one real photo resized to about
``N = 256*28*28`` and ``1024*28*28`` pixels (``min_pixels = max_pixels = N``, so the photo is
scaled to that budget: ~256 / ~1024 visual tokens), ours vs HF
``Qwen2_5_VLForConditionalGeneration.generate(max_new_tokens=1)`` on the same input ids,
``pixel_values`` and ``image_grid_thw`` (from ``llm.engine.process_prompt``). Both timings
start from preprocessed pixels; our encoder cache is cleared and prefix caching is off, so
every run runs the vision tower and the full prefill. Reported: speed-up = HF TTFT / ours.

``mix``: requests arriving one after another over 2 distinct photos with
the same question; per-request TTFT through the stream API with prefix caching + encoder
cache on vs off (``enable_prefix_caching=False`` and an encoder cache of size 0).

All times are seconds (tables show milliseconds).
"""

from __future__ import annotations

import statistics

import torch

from benchmarks.common import (
    best_of,
    dtype_name,
    fmt,
    image_path,
    log,
    markdown_table,
    now,
    section,
    vlm_model_path,
)

QUESTION = "Describe this image in one sentence."


def _messages(photo: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image_path(photo)},
                                         {"type": "text", "text": QUESTION}]}]


def run(quick: bool = False, dtype: torch.dtype = torch.float32, photo: str = "rocket.jpg") -> dict:
    """TTFT ours vs HF at two pixel budgets. Returns seconds per budget and the speed-ups."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from atlas_vlm import LLM, SamplingParams

    repeats = 2 if quick else 3
    section(f"VLM time to first token: 1 image ({photo}), random-weight Qwen2.5-VL {dtype_name(dtype)}, "
            f"best of {repeats}")
    folder = vlm_model_path()
    llm = LLM(folder, dtype=dtype_name(dtype), max_model_len=2048, max_num_batched_tokens=2048, num_kvcache_blocks=256,
              enable_prefix_caching=False)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    runner = llm.engine.runner
    rows, out = [], {}
    for tokens in (256, 1024):
        n = tokens * 28 * 28
        mm = {"min_pixels": n, "max_pixels": n}
        p = llm.engine.process_prompt({"messages": _messages(photo), "mm_options": mm})
        img = p.images[0]

        def ours():
            llm.engine.reset_mm_cache()
            return llm.generate(p, params, use_tqdm=False)[0].token_ids

        def ours_e2e():  # from the chat messages: image load, resize and patchify included
            llm.engine.reset_mm_cache()
            return llm.chat(_messages(photo), params, mm_options=mm, use_tqdm=False)[0].token_ids

        ids = torch.tensor([p.prompt_token_ids])

        def hf_ttft():
            with torch.inference_mode():
                o = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=img.pixel_values,
                                image_grid_thw=torch.tensor([list(img.grid_thw)]), max_new_tokens=1,
                                do_sample=False, temperature=None, top_p=None, top_k=None)
            return o[0, ids.shape[1]:].tolist()

        log(f"TTFT at {tokens}*28*28 pixels ({img.num_tokens} visual tokens, prompt {ids.shape[1]})")
        t_ours, tok_ours = best_of(ours, repeats)
        t_e2e, _ = best_of(ours_e2e, repeats)
        t_hf, tok_hf = best_of(hf_ttft, repeats)
        out[f"{tokens}x28x28"] = {
            "visual_tokens": img.num_tokens, "prompt_tokens": ids.shape[1], "resized_hw": list(img.resized_hw),
            "ours_ttft_s": t_ours, "ours_e2e_ttft_s": t_e2e, "hf_ttft_s": t_hf, "speedup_hf_over_ours": t_hf / t_ours,
            "first_token_equal": tok_ours == tok_hf,
        }
        rows.append([f"{tokens}*28*28 ({img.resized_hw[1]}x{img.resized_hw[0]})", img.num_tokens,
                     fmt(t_hf / t_ours), fmt(1000 * t_ours, 1), fmt(1000 * t_hf, 1), fmt(1000 * t_e2e, 1),
                     "yes" if tok_ours == tok_hf else f"NO ({tok_ours} vs {tok_hf})"])
    print(markdown_table(["max_pixels", "visual tokens", "speed-up (HF / ours)", "ours TTFT ms", "HF TTFT ms",
                          "ours TTFT ms incl. image preprocessing", "first token = HF"], rows))
    return out


def mix(quick: bool = False, dtype: torch.dtype = torch.float32) -> dict:
    """Requests arriving one at a time over 2 photos (same question): TTFT with prefix caching
    + encoder cache on vs off. Returns per setting the TTFTs (seconds) and encoder runs."""
    from atlas_vlm import LLM, SamplingParams

    num = 4 if quick else 8
    photos = ["chelsea.png", "coffee.png"]
    mm = {"max_pixels": 256 * 28 * 28}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    section(f"VLM mix: {num} requests one after another over {len(photos)} photos, same question "
            "(max_pixels 256*28*28)")
    folder = vlm_model_path()
    res = {}
    for name, caching in (("caches on", True), ("caches off", False)):
        log(f"mix: {name}")
        llm = LLM(folder, dtype=dtype_name(dtype), max_model_len=2048, num_kvcache_blocks=512,
                  enable_prefix_caching=caching, encoder_cache_tokens=16384 if caching else 0)  # 0: tower every time
        llm.chat([{"role": "user", "content": [{"type": "image", "image": image_path("rocket.jpg")},
                                               {"type": "text", "text": "Warm up."}]}],
                 params, mm_options=mm, use_tqdm=False)  # warm-up on a third photo
        runs0 = llm.engine.runner.num_encoder_runs
        ttfts, tokens = [], []
        for i in range(num):
            t0, first = now(), None
            for o in llm.chat(_messages(photos[i % len(photos)]), params, mm_options=mm, stream=True, use_tqdm=False):
                if first is None and o.token_ids:
                    first = now()
                last = o
            ttfts.append(first - t0)
            tokens.append(list(last.token_ids))
        res[name] = {"ttft_s": ttfts, "encoder_runs": llm.engine.runner.num_encoder_runs - runs0, "tokens": tokens}
        del llm
    on, off = res["caches on"], res["caches off"]
    k = len(photos)
    rows = []
    for name, r in res.items():
        first, rep = r["ttft_s"][:k], r["ttft_s"][k:]
        rows.append([name, fmt(1000 * statistics.mean(r["ttft_s"]), 1), fmt(1000 * statistics.mean(first), 1),
                     fmt(1000 * statistics.mean(rep), 1), r["encoder_runs"]])
    speedup = statistics.mean(off["ttft_s"][k:]) / statistics.mean(on["ttft_s"][k:])
    same = on["tokens"] == off["tokens"]
    print(markdown_table(["setting", "mean TTFT ms", "first sight of a photo ms", "repeated photo ms",
                          "vision-tower runs"], rows))
    print(f"\nrepeated-photo TTFT speed-up (off / on): {speedup:.2f}x; greedy tokens equal on vs off: {same}")
    for r in res.values():
        r.pop("tokens")
    return {**res, "repeated_speedup_off_over_on": speedup, "tokens_equal_on_off": same}
