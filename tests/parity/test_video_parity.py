"""Video on the paged KV cache against HF ``generate`` on the same random weights, for every
family (Qwen2.5-VL, Qwen2-VL, Qwen3-VL, SmolVLM2; fp32, CPU): first-step and per-step
logits within 1e-4, greedy tokens equal, prompt positions equal HF ``get_rope_index`` (with
``second_per_grid_ts`` on Qwen2.5-VL) -- one video, a video with an image, two videos,
batched with a text-only request, chunked prefill cutting through a video, the encoder and
prefix caches on a repeated video, and preemption. The test clips show their frame index
in every frame (tests/data/videos/README.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import CPU_FP32, IMAGES, assert_matches_hf, assert_preempted_match_hf, chat, conv
from tiny_vlms import QWEN3_VL_PIX, build_tiny_qwen3_vl, build_tiny_smolvlm
from atlas_vlm import LLM, SamplingParams

pytestmark = pytest.mark.vlm

VIDEOS = Path(__file__).resolve().parent.parent / "data" / "videos"
CLIP = VIDEOS / "frames_30fps_90.mp4"  # 3 s, 30 fps: 6 frames at fps 2 (3 temporal groups)
SHORT = VIDEOS / "short_0.5s_30fps.mp4"  # 0.5 s: one temporal group
N = 8  # generated tokens per request
FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "smolvlm")
PIX = {"qwen2_5_vl": 28 * 28, "qwen2_vl": 28 * 28, "qwen3_vl": QWEN3_VL_PIX}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_models, tmp_path_factory):
    name = request.param
    if name == "qwen3_vl":
        folder = tmp_path_factory.mktemp("video_qwen3_vl")
        return name, folder, build_tiny_qwen3_vl(folder).eval()
    if name == "smolvlm":
        folder = tmp_path_factory.mktemp("video_smolvlm")
        return name, folder, build_tiny_smolvlm(folder).eval()
    folder, hf = tiny_models[name]
    return name, folder, hf.eval()


@pytest.fixture(scope="module")
def llm(family):
    return LLM(str(family[1]), max_model_len=2048, num_kvcache_blocks=512, kvcache_block_size=16, **CPU_FP32)


def video(family, path=CLIP, **options):
    """A video item bounded to a few tokens per frame group on the Qwen families."""
    item = {"type": "video", "video": str(path), **options}
    if family[0] in PIX:
        item.setdefault("min_pixels", 4 * PIX[family[0]])  # qwen-vl-utils' default is 128 tokens a frame
        item.setdefault("max_pixels", 16 * PIX[family[0]])
    return item


def image(family):
    item = {"type": "image", "image": str(IMAGES / "chelsea.png")}
    if family[0] in PIX:
        item.update(min_pixels=4 * PIX[family[0]], max_pixels=32 * PIX[family[0]])
    return item


def test_one_video_matches_hf(family, llm):
    c = conv(video(family), text="What happens in this video?")
    (out,), rec = chat(llm, [c], N)
    p = assert_matches_hf(llm, family[2], c, out, rec, N)
    assert p.videos and not p.images
    frames = {"smolvlm": 3}.get(family[0], 6)  # SmolVLM: 1 fps over 3 s; Qwen: fps 2
    sampled = p.videos if family[0] == "smolvlm" else p.videos[0].frame_indices
    assert len(sampled) == frames
    if family[0] != "smolvlm":
        assert p.videos[0].frame_indices == [0, 18, 36, 53, 71, 89]  # linspace(0, 89, 6).round(), qwen-vl-utils
        assert p.videos[0].grid_thw[0] == 3
    if family[0] == "qwen3_vl":  # one placeholder run per temporal group, timestamps between
        assert len(p.mm_positions) == 3
        text = llm.tokenizer.decode(out.prompt_token_ids)
        # each group's mean frame time from the SOURCE fps: (0+18)/2/30, (36+53)/2/30, (71+89)/2/30 s
        assert p.videos[0].timestamps == pytest.approx([0.3, 89 / 60, 160 / 60])
        assert all(f"<{t} seconds><|vision_start|><|video_pad|>" in text for t in ("0.3", "1.5", "2.7"))


def test_video_with_an_image_and_two_videos_match_hf(family, llm):
    mixed = conv(image(family), video(family), text="Compare the picture and the clip.")
    two = conv(video(family), video(family, SHORT), text="Which clip is longer?")
    (out1, out2), rec = chat(llm, [mixed, two], N)
    p1 = assert_matches_hf(llm, family[2], mixed, out1, rec, N)
    p2 = assert_matches_hf(llm, family[2], two, out2, rec, N)
    assert [it.modality for it in p1.mm_items][-1] == "video" and p1.images
    assert len({it.content_hash for it in p2.mm_items}) == len(p2.mm_items)  # two different clips


def test_batched_with_text_and_chunked_through_a_video(family):
    llm = LLM(str(family[1]), max_model_len=2048, num_kvcache_blocks=512, max_num_batched_tokens=10,
              max_num_encoder_tokens=4096, **CPU_FP32)
    c = conv(video(family), text="Describe the clip.")
    text = [{"role": "user", "content": "Count to five."}]
    (out, out_text), rec = chat(llm, [c, text], N)
    p = assert_matches_hf(llm, family[2], c, out, rec, N)
    cuts = [r["start"] for r in rec.by_request[out.request_id] if r["start"] < r["num_prompt"]]
    inside = [x for x in cuts for r in p.mm_positions if r.offset < x < r.end]
    assert inside, (cuts, p.mm_positions)  # a chunk boundary inside a video's placeholder run
    assert out_text.finish_reason in ("length", "stop") and len(out_text.token_ids) >= 1


def test_repeated_video_hits_the_encoder_and_prefix_caches(family):
    llm = LLM(str(family[1]), max_model_len=2048, num_kvcache_blocks=512, **CPU_FP32)
    first = conv(video(family), text="What moves in the clip?")
    (out1,), _ = chat(llm, [first], N)
    runs = llm.engine.runner.num_encoder_runs
    second = conv(video(family), text="What colour is the square?")
    (out2,), rec = chat(llm, [second], N)
    p = assert_matches_hf(llm, family[2], second, out2, rec, N)
    assert llm.engine.runner.num_encoder_runs == runs  # no tower run: the encoder cache held it
    cached = rec.by_request[out2.request_id][0]["req"].num_cached_tokens
    assert cached >= 16 and cached > p.mm_positions[0].offset  # the prefix cache reached into the video
    other = conv(video(family, fps=1.5), text="What moves in the clip?")  # other sampling: other content
    assert llm.engine.process_prompt({"messages": other}).mm_items[0].content_hash != p.mm_items[0].content_hash


def test_preempted_video_request_recomputes_to_the_same_answer(family):
    """Too few blocks of 16 tokens for two video requests decoding 24 tokens each (SmolVLM's
    prompts are longer: more blocks): one is preempted and recomputed from its start (its
    video fed again), and both still equal HF token for token, logits within 1e-4 at every step."""
    blocks = 13 if family[0] == "smolvlm" else 9  # both prompts admitted, their decodes do not fit
    llm = LLM(str(family[1]), max_model_len=256, num_kvcache_blocks=blocks, kvcache_block_size=16,
              enable_prefix_caching=False, **CPU_FP32)
    convs = [conv(video(family), text="First question about the clip."),
             conv(video(family, SHORT), text="Second question.")]
    outs, rec = chat(llm, convs, 24)
    assert_preempted_match_hf(llm, family[2], convs, outs, rec, 24)


def test_a_video_over_max_model_len_is_refused_naming_it_before_any_block(family, monkeypatch):
    """Refused with the video, its frames and tokens named, nothing allocated; on the Qwen
    families from the stream's facts alone, before a frame is decoded."""
    from mm_token_pipeline import video_io

    llm = LLM(str(family[1]), max_model_len=32, num_kvcache_blocks=64, **CPU_FP32)
    c = conv(video(family), text="Too long?")
    if family[0] in PIX:
        def no_decoding(*args, **kwargs):
            raise AssertionError("decoded a video that was refused by its probe")
        monkeypatch.setattr(video_io, "_decode_frames", no_decoding)
    with pytest.raises(ValueError, match=r"video 0 \(.*frames_30fps_90.mp4\): \d+ frames.* \d+ (visual )?tokens") as e:
        llm.chat(c, SamplingParams(max_tokens=4), use_tqdm=False)
    assert "max_model_len is 32" in str(e.value)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests
    monkeypatch.undo()
    (out,) = llm.chat([conv(video(family), text="Too long?"), [{"role": "user", "content": "Hi"}]],
                      SamplingParams(max_tokens=2), use_tqdm=False)[1:]  # the other request of a batch runs
    assert out.finish_reason == "length"
