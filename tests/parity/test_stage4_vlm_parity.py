"""Stage 4 (visual tokens on the paged KV cache): MAC-V1 (greedy tokens and logits) and
MAC-V3 (M-RoPE positions and rope_delta) at the engine level, against HF
``Qwen2_5_VLForConditionalGeneration`` on the same random weights; also the contiguous cache
against the paged one. MAC-V2 bounds and cases C08, C15, C16 are in test_stage4_vlm_bounds.py.

Every engine call here goes through ``LLM.chat``, recorded by ``_vlm_helpers.record``.
"""

from __future__ import annotations

import pytest
import torch

from helpers import CPU_FP32, IMAGE_PAD, IMAGES, MEDIUM, SMALL, assert_matches_hf, chat, conv, greedy
from atlas_vlm import LLM

pytestmark = pytest.mark.vlm


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm_contiguous(vl):
    return LLM(str(vl[0]), kv_cache="contiguous", max_model_len=1024, num_kvcache_blocks=4, **CPU_FP32)


@pytest.fixture
def hf(vl):
    return vl[1]


# ---- MAC-V1 parity -------------------------------------------------------------------------------
def test_one_image_matches_hf(llm, hf):
    c = conv(IMAGES / "chelsea.png", text="Describe this image.")
    (out,), rec = chat(llm, [c], 16, MEDIUM)
    p = assert_matches_hf(llm, hf, c, out, rec, 16, MEDIUM)
    assert len(p.images) == 1 and p.images[0].num_tokens <= 256


def test_single_conversation_chat_matches_list_form(llm):
    c = conv(IMAGES / "chelsea.png", text="Describe this image.")
    (single,) = llm.chat(c, greedy(4), mm_options=SMALL, use_tqdm=False)
    (listed,), _ = chat(llm, [c], 4, SMALL)
    assert single.token_ids == listed.token_ids
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_two_images_of_different_sizes_in_one_prompt(llm, hf):
    c = conv(IMAGES / "chelsea.png", IMAGES / "grace_hopper.jpg", text="Compare the two pictures.")
    (out,), rec = chat(llm, [c], 16, SMALL)
    p = assert_matches_hf(llm, hf, c, out, rec, 16, SMALL)
    assert len(p.images) == 2 and p.images[0].grid_thw != p.images[1].grid_thw
    assert sum(t == IMAGE_PAD for t in p.prompt_token_ids) == sum(im.num_tokens for im in p.images)


def test_image_after_text(llm, hf):
    c = [{"role": "user", "content": [{"type": "text", "text": "Look at this:"},
                                      {"type": "image", "image": str(IMAGES / "coffee.png")}]}]
    (out,), rec = chat(llm, [c], 16, SMALL)
    p = assert_matches_hf(llm, hf, c, out, rec, 16, SMALL)
    first_pad = p.prompt_token_ids.index(IMAGE_PAD)
    text_ids = llm.tokenizer("Look at this:", add_special_tokens=False)["input_ids"]
    before = p.prompt_token_ids[:first_pad]
    assert any(before[i:i + len(text_ids)] == text_ids for i in range(len(before)))


def test_several_requests_with_different_images_in_one_call(llm, hf):
    """Four conversations batched in one call (different images, one text-only, one with the
    image after the text); each equals its own HF run. Decode steps that run requests with
    different rope_deltas together feed each its own ``context_len + rope_delta`` (MAC-V3)."""
    convs = [
        conv(IMAGES / "coffee.png", text="What is in the cup?"),
        conv(IMAGES / "grace_hopper.jpg", text="Who is this?"),
        [{"role": "user", "content": [{"type": "text", "text": "A rocket:"},
                                      {"type": "image", "image": str(IMAGES / "rocket.jpg")},
                                      {"type": "text", "text": "Where is it going?"}]}],
        [{"role": "user", "content": "Just text, no image."}],
    ]
    outs, rec = chat(llm, convs, 16, SMALL)
    assert len(outs) == len(convs)
    deltas = {}
    for c, out in zip(convs, outs):
        p = assert_matches_hf(llm, hf, c, out, rec, 16, SMALL)
        deltas[out.request_id] = p.rope_delta
    assert len(set(deltas.values())) >= 3, deltas

    # a decode step where requests with different rope_deltas run together
    mixed = [step for step in rec.steps
             if len({r["rope_delta"] for r in step if r["start"] >= r["num_prompt"]}) >= 2]
    assert mixed, "no decode step ran two requests with different rope_deltas together"
    for step in mixed:
        for r in step:
            if r["start"] < r["num_prompt"]:
                continue
            assert r["rope_delta"] == deltas[r["rid"]]
            expect = (torch.arange(r["start"], r["end"]) + deltas[r["rid"]])[None].expand(3, -1)
            assert torch.equal(r["positions"], expect)
            assert torch.equal(r["req"].positions(r["start"], r["end"]), expect)


def test_contiguous_cache_equals_paged(llm, llm_contiguous):
    convs = [conv(IMAGES / "chelsea.png", text="Describe."),
             conv(IMAGES / "camera.png", IMAGES / "logo.png", text="Two images.")]
    paged, rec_p = chat(llm, convs, 12, SMALL)
    contiguous, rec_c = chat(llm_contiguous, convs, 12, SMALL)
    for a, b in zip(paged, contiguous):
        assert a.token_ids == b.token_ids
        assert a.prompt_token_ids == b.prompt_token_ids
        la, lb = rec_p.sampled_logits(a.request_id), rec_c.sampled_logits(b.request_id)
        assert len(la) == len(lb) == 12
        for x, y in zip(la, lb):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
