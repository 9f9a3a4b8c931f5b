"""Qwen3.5 as a VLM through ``LLM.chat`` (the engine's state slots, tower, encoder cache and
media inputs together) against HF 5.25 ``Qwen3_5ForConditionalGeneration`` ``generate`` on the
same random weights (fp32, CPU): greedy tokens equal, the first step's and every sampled step's
logits within 1e-4, prompt positions equal HF ``get_rope_index``, decode positions shifted by
the rope delta -- an image prompt batched beside a text and a two-image prompt, a chunked
prefill cut inside the image, a video, preemption recomputing image prompts, a repeated image
served by the encoder cache -- with every state slot given back; and ``plan``'s weight and state
bytes equal the engine's.
"""

from __future__ import annotations

import pytest

from atlas_vlm import LLM
from helpers import CPU_FP32, IMAGES, assert_matches_hf, chat, conv
from qwen3_5_helpers import build_tiny_qwen3_5, tiny_vl_config

pytestmark = pytest.mark.vlm

PX = 32 * 32  # pixels per visual token (patch 16, merge 2)
BOUNDS = {"min_pixels": 16 * PX, "max_pixels": 40 * PX}
N = 8
MAX_SEQS = 4


@pytest.fixture(scope="module")
def q35(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_qwen3_5_vl_engine")
    return folder, build_tiny_qwen3_5(folder, seed=21, config=tiny_vl_config())


def make_llm(folder, **kwargs) -> LLM:
    return LLM(str(folder), **{**dict(max_model_len=1024, num_kvcache_blocks=256, kvcache_block_size=16,
                                      max_num_seqs=MAX_SEQS), **CPU_FP32, **kwargs})


def assert_slots_back(llm) -> None:
    assert llm.engine.runner.state_cache.num_free_slots == MAX_SEQS


def test_image_prompt_batched_with_text_and_two_images(q35):
    folder, hf = q35
    llm = make_llm(folder)
    convs = [conv(IMAGES / "chelsea.png", text="Describe this image."),
             [{"role": "user", "content": "Just text, no image."}],
             conv(IMAGES / "grace_hopper.jpg", IMAGES / "rocket.jpg", text="Compare them.")]
    outs, rec = chat(llm, convs, N, BOUNDS)
    for c, out in zip(convs, outs):
        assert_matches_hf(llm, hf, c, out, rec, N, BOUNDS)
    assert any(len(step) >= 2 for step in rec.steps), "the requests never ran in one batch"
    assert llm.engine.runner.vision is not None and llm.engine.runner.num_encoder_runs >= 1
    assert_slots_back(llm)


def test_chunked_prefill_cut_inside_the_image(q35):
    folder, hf = q35
    llm = make_llm(folder, max_num_batched_tokens=16)
    c = conv(IMAGES / "chelsea.png", text="Describe this image.")
    (out,), rec = chat(llm, [c], N, BOUNDS)
    p = assert_matches_hf(llm, hf, c, out, rec, N, BOUNDS)
    (span,) = p.image_spans
    cuts = [r["start"] for r in rec.by_request[out.request_id] if r["start"] < r["num_prompt"]]
    assert len([x for x in cuts if span.offset < x < span.offset + span.length]) >= 2, (cuts, span)
    assert_slots_back(llm)


def test_video_prompt(q35):
    folder, hf = q35
    llm = make_llm(folder)
    video = {"type": "video", "video": str(IMAGES.parent / "videos" / "frames_30fps_90.mp4"),
             "max_pixels": 12 * PX, "min_pixels": 4 * PX}
    c = conv(video, text="What happens?")
    (out,), rec = chat(llm, [c], N, BOUNDS)
    p = assert_matches_hf(llm, hf, c, out, rec, N, BOUNDS)
    assert len(p.videos) == 1 and p.videos[0].grid_thw[0] > 1
    assert_slots_back(llm)


def test_plan_counts_the_engine_weights(q35):
    """``plan`` of the VLM config: its weight bytes equal what the engine holds (decoder and
    tower, fp32), its state bytes the engine's state cache."""
    from transformers import AutoConfig

    from atlas_vlm.memory_plan import plan

    folder, _ = q35
    llm = make_llm(folder)
    runner = llm.engine.runner
    p = plan(AutoConfig.from_pretrained(folder), dtype="fp32", block_size=16, max_num_seqs=MAX_SEQS)
    tower = sum(t.numel() for t in runner.vision.parameters()) * 4
    decoder = sum(t.numel() for t in runner.model.parameters()) * 4  # tied weights counted once
    assert p.vision_weight_bytes == tower > 0
    assert p.weight_bytes == decoder + tower
    assert p.state_bytes == runner.state_cache.conv.nbytes + runner.state_cache.recurrent.nbytes


def test_preemption_recomputes_the_images_and_the_state(q35):
    """Too few blocks for two image prompts (about 50 tokens each, 3 blocks of 16) decoding 24
    tokens (2 more blocks each) in 8 blocks: one is preempted, its state slot given back and its
    prompt (images included) recomputed from a fresh state; both still equal HF."""
    from helpers import assert_preempted_match_hf

    folder, hf = q35
    llm = make_llm(folder, num_kvcache_blocks=8)
    convs = [conv(IMAGES / "chelsea.png", text="Describe this image."),
             conv(IMAGES / "grace_hopper.jpg", text="Who is this?")]
    outs, rec = chat(llm, convs, 24, BOUNDS)
    assert_preempted_match_hf(llm, hf, convs, outs, rec, 24, BOUNDS)
    assert_slots_back(llm)


def test_a_repeated_image_is_encoded_once(q35):
    """These ~50-token prompts end before the first state snapshot (every 256 tokens), so prefix
    caching has no hit for this hybrid model, but the encoder cache still serves a repeated
    image: the second prompt runs no tower and still equals HF."""
    folder, hf = q35
    llm = make_llm(folder)
    for text in ("Describe this image.", "What colour is the cat?"):
        c = conv(IMAGES / "chelsea.png", text=text)
        (out,), rec = chat(llm, [c], N, BOUNDS)
        assert_matches_hf(llm, hf, c, out, rec, N, BOUNDS)
        assert rec.by_request[out.request_id][0]["req"].num_cached_tokens == 0
    assert llm.engine.runner.num_encoder_runs == 1
    assert_slots_back(llm)
