"""Qwen3-VL on the paged KV cache against HF ``Qwen3VLForConditionalGeneration`` on the same
random weights (tests/tiny_vlms.py): first-step logits within 1e-4, greedy tokens equal
``generate`` (fp32, CPU), prompt positions equal HF ``get_rope_index`` (with an attention
mask) -- text only, one, two and three images, batched with other requests, chunked prefill
that splits an image, prefix and encoder caching with a repeated image. Also: DeepStack is
really exercised (HF without it differs) and interleaved M-RoPE equals HF's tables.
"""

from __future__ import annotations

import pytest
import torch

from helpers import (CPU_FP32, IMAGE_PAD, IMAGES, LOGITS_ATOL, assert_matches_hf, assert_preempted_match_hf, chat,
                     conv, hf_inputs)
from tiny_vlms import QWEN3_VL_PIX, build_tiny_qwen3_vl
from atlas_vlm import LLM

pytestmark = pytest.mark.vlm

SMALL = {"max_pixels": 64 * QWEN3_VL_PIX}
N = 12  # generated tokens per request


@pytest.fixture(scope="module")
def q3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_qwen3_vl")
    return folder, build_tiny_qwen3_vl(folder)


@pytest.fixture(scope="module")
def hf(q3):
    return q3[1]


@pytest.fixture(scope="module")
def llm(q3):
    return LLM(str(q3[0]), max_model_len=2048, num_kvcache_blocks=512, kvcache_block_size=16, **CPU_FP32)


def test_text_only_matches_hf(llm, hf):
    c = [{"role": "user", "content": "Hello, what can you see today?"}]
    (out,), rec = chat(llm, [c], N)
    p = assert_matches_hf(llm, hf, c, out, rec, N)
    assert not p.images and p.rope_delta == 0


def test_one_image_matches_hf_and_respects_the_patch16_bound(llm, hf):
    c = conv(IMAGES / "chelsea.png", text="Describe this image.")
    (out,), rec = chat(llm, [c], N, SMALL)
    p = assert_matches_hf(llm, hf, c, out, rec, N, SMALL)
    (img,) = p.images
    assert img.num_tokens <= 64  # max_pixels / (32*32)
    assert img.pixel_values.shape[1] == 3 * 2 * 16 * 16
    assert img.resized_hw[0] % 32 == 0 and img.resized_hw[1] % 32 == 0


@pytest.mark.parametrize("images", [
    ("chelsea.png", "grace_hopper.jpg"),
    ("coffee.png", "rocket.jpg", "camera.png"),
])
def test_several_images_in_one_prompt(llm, hf, images):
    c = conv(*[IMAGES / name for name in images], text="Compare the pictures.")
    (out,), rec = chat(llm, [c], N, SMALL)
    p = assert_matches_hf(llm, hf, c, out, rec, N, SMALL)
    assert len(p.images) == len(images)
    assert sum(t == IMAGE_PAD for t in p.prompt_token_ids) == sum(im.num_tokens for im in p.images)
    assert len({im.grid_thw for im in p.images}) >= 2  # different sizes in one prompt


def test_batched_with_other_requests(llm, hf):
    convs = [
        conv(IMAGES / "coffee.png", text="What is in the cup?"),
        [{"role": "user", "content": "Just text, no image."}],
        [{"role": "user", "content": [{"type": "text", "text": "A rocket:"},
                                      {"type": "image", "image": str(IMAGES / "rocket.jpg")},
                                      {"type": "text", "text": "Where is it going?"}]}],
        conv(IMAGES / "grace_hopper.jpg", IMAGES / "logo.png", text="Two."),
    ]
    outs, rec = chat(llm, convs, N, SMALL)
    for c, out in zip(convs, outs):
        assert_matches_hf(llm, hf, c, out, rec, N, SMALL)
    assert any(len(step) >= 3 for step in rec.steps), "the requests never ran in one batch"


def test_chunked_prefill_splits_an_image(q3, hf):
    """A small step budget cuts the image's pad run between steps: each chunk adds the
    matching rows of the main and every DeepStack feature."""
    llm = LLM(str(q3[0]), max_model_len=1024, num_kvcache_blocks=128, max_num_batched_tokens=20, **CPU_FP32)
    c = conv(IMAGES / "chelsea.png", text="Describe this image.")
    (out,), rec = chat(llm, [c], N, SMALL)
    p = assert_matches_hf(llm, hf, c, out, rec, N, SMALL)
    (span,) = p.image_spans
    cuts = [r["start"] for r in rec.by_request[out.request_id] if r["start"] < r["num_prompt"]]
    inside = [x for x in cuts if span.offset < x < span.offset + span.length]
    assert len(inside) >= 2, (cuts, span)


@pytest.mark.parametrize("budget", [2048, 6])  # 6: chunk cuts inside the image after the hit too
def test_prefix_and_encoder_cache_with_a_repeated_image(q3, hf, budget):
    """Same image, then different questions: the second prompt's prefix-cache hit ends
    inside the image (the rest of the image computed with the matching DeepStack slice),
    the third's covers the whole image (no feature needed); the tower runs once."""
    llm = LLM(str(q3[0]), max_model_len=1024, num_kvcache_blocks=128, max_num_batched_tokens=budget, **CPU_FP32)
    first = conv(IMAGES / "chelsea.png", text="Describe this image.")
    (out1,), rec1 = chat(llm, [first], N, SMALL)
    assert_matches_hf(llm, hf, first, out1, rec1, N, SMALL)
    assert llm.engine.runner.num_encoder_runs == 1

    second = conv(IMAGES / "chelsea.png", text="What colour is the cat?")
    (out2,), rec2 = chat(llm, [second], N, SMALL)
    p2 = assert_matches_hf(llm, hf, second, out2, rec2, N, SMALL)
    (span,) = p2.image_spans
    cached = rec2.by_request[out2.request_id][0]["req"].num_cached_tokens
    assert span.offset < cached < span.offset + span.length, (cached, span)
    assert llm.engine.runner.num_encoder_runs == 1  # encoder cache hit
    if budget == 6:  # after the hit, a chunk boundary still falls inside the image
        cuts = [r["end"] for r in rec2.by_request[out2.request_id] if r["end"] < r["num_prompt"]]
        assert any(cached < x < span.offset + span.length for x in cuts), (cached, cuts, span)

    long_text = "Please describe every detail of this picture, the colours, the shapes and the light. "
    third_a = conv(IMAGES / "chelsea.png", text=long_text + "Answer briefly.")
    third_b = conv(IMAGES / "chelsea.png", text=long_text + "Answer in one word.")
    chat(llm, [third_a], 2, SMALL)
    (out3,), rec3 = chat(llm, [third_b], N, SMALL)
    p3 = assert_matches_hf(llm, hf, third_b, out3, rec3, N, SMALL)
    (span,) = p3.image_spans
    assert rec3.by_request[out3.request_id][0]["req"].num_cached_tokens >= span.offset + span.length
    assert llm.engine.runner.num_encoder_runs == 1

    # with the encoder cache emptied, a prefix hit covering the whole image needs no features:
    # the tower does not run, and the answer is still HF's
    llm.engine.reset_mm_cache()
    third_c = conv(IMAGES / "chelsea.png", text=long_text + "Answer with a colour.")
    (out4,), rec4 = chat(llm, [third_c], N, SMALL)
    assert_matches_hf(llm, hf, third_c, out4, rec4, N, SMALL)
    assert llm.engine.runner.num_encoder_runs == 1
    assert not llm.engine.runner.encoder_outputs  # nothing encoded for it, nothing kept


@torch.no_grad()
def test_deepstack_changes_the_logits(llm, hf):
    """The parity above checks DeepStack: HF's own forward without the DeepStack features
    gives logits far from the full model's (and from ours)."""
    c = conv(IMAGES / "chelsea.png", text="Describe this image.")
    p = llm.engine.process_prompt({"messages": c, "mm_options": SMALL})
    kwargs = hf_inputs(p)
    full = hf(**kwargs).logits[0, -1]
    embeds = hf.model.get_image_features(kwargs["pixel_values"], kwargs["image_grid_thw"]).pooler_output
    x = hf.model.get_input_embeddings()(kwargs["input_ids"])
    mask = kwargs["input_ids"] == IMAGE_PAD
    x[mask] = torch.cat(embeds)
    positions, _ = hf.model.get_rope_index(kwargs["input_ids"], kwargs["mm_token_type_ids"],
                                           image_grid_thw=kwargs["image_grid_thw"],
                                           attention_mask=kwargs["attention_mask"])
    plain = hf.model.language_model(inputs_embeds=x, position_ids=positions,
                                    attention_mask=kwargs["attention_mask"]).last_hidden_state
    no_deepstack = hf.lm_head(plain)[0, -1]
    assert (full - no_deepstack).abs().max() > 100 * LOGITS_ATOL


def test_interleaved_mrope_equals_hf_tables():
    """Our cos/sin equal HF ``Qwen3VLTextRotaryEmbedding`` for the real Qwen3-VL geometry
    (head_dim 128, mrope_section [24, 20, 20], theta 5e6) on distinct T/H/W positions."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from atlas_vlm.layers.rotary import RotaryEmbedding

    cfg = Qwen3VLTextConfig(head_dim=128, hidden_size=2560, num_attention_heads=32, rope_theta=5_000_000,
                            rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20],
                                          "mrope_interleaved": True})
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 3000, (3, 50), generator=gen)
    cos_hf, sin_hf = Qwen3VLTextRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions[:, None])
    ours = RotaryEmbedding(cfg, [24, 20, 20], mrope_interleaved=True)
    cos, sin = ours(positions, torch.float32)
    torch.testing.assert_close(cos, cos_hf[0], atol=0, rtol=0)
    torch.testing.assert_close(sin, sin_hf[0], atol=0, rtol=0)
    blocks = RotaryEmbedding(cfg, [24, 20, 20])  # the Qwen2.5-VL layout is a different table
    assert not torch.allclose(blocks(positions, torch.float32)[0], cos_hf[0])


def test_preemption_recomputes_images_with_their_deepstack_rows(q3, hf):
    """Too few blocks for both requests (prompts of 68 and 70 tokens take 5 blocks each of
    the 10; decoding 24 more needs 2 more each): one is preempted and recomputed (its images, and
    their DeepStack rows, fed again); both still equal HF."""
    llm = LLM(str(q3[0]), max_model_len=512, num_kvcache_blocks=10, enable_prefix_caching=False, **CPU_FP32)
    convs = [conv(IMAGES / "chelsea.png", text="Describe this image."),
             conv(IMAGES / "grace_hopper.jpg", text="Who is this?")]
    outs, rec = chat(llm, convs, 24, SMALL)
    assert_preempted_match_hf(llm, hf, convs, outs, rec, 24, SMALL)


def test_without_an_image_template_qwen3_vl_falls_back_to_its_own(q3, tmp_path):
    """A Qwen3-VL folder whose tokenizer template renders no images gets the Qwen3-VL
    template (no default system prompt), not Qwen2.5-VL's."""
    import shutil

    folder = tmp_path / "no_template"
    shutil.copytree(q3[0], folder)
    (folder / "chat_template.jinja").unlink()
    llm = LLM(str(folder), num_kvcache_blocks=32, **CPU_FP32)
    assert "image_pad" not in (llm.tokenizer.chat_template or "")
    p = llm.engine.process_prompt({"messages": conv(IMAGES / "logo.png", text="Hi"), "mm_options": SMALL})
    text = llm.tokenizer.decode(p.prompt_token_ids)
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|>")
    assert text.endswith("<|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n")


def test_over_budget_image_is_refused_before_allocation(q3):
    """MAC-V2 for Qwen3-VL: the token count (<= max_pixels / 32**2) is known before any K/V;
    a prompt that cannot fit is refused with nothing allocated."""
    from atlas_vlm.engine.engine import RequestTooLongError

    llm = LLM(str(q3[0]), max_model_len=100, num_kvcache_blocks=32, **CPU_FP32)
    bm = llm.engine.block_manager
    c = conv(IMAGES / "logo.png", text="Hi")
    p = llm.engine.process_prompt({"messages": c, "mm_options": {"max_pixels": 256 * QWEN3_VL_PIX}})
    assert 100 < p.images[0].num_tokens <= 256
    with pytest.raises(RequestTooLongError, match="max_model_len"):
        llm.engine.add_request({"messages": c, "mm_options": {"max_pixels": 256 * QWEN3_VL_PIX}})
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests


def test_contiguous_cache_equals_paged(q3, llm):
    contiguous = LLM(str(q3[0]), kv_cache="contiguous", max_model_len=512, num_kvcache_blocks=2, **CPU_FP32)
    convs = [conv(IMAGES / "chelsea.png", text="Describe."), conv(IMAGES / "camera.png", IMAGES / "logo.png", text="Two.")]
    paged, rec_p = chat(llm, convs, N, SMALL)
    contig, rec_c = chat(contiguous, convs, N, SMALL)
    for a, b in zip(paged, contig):
        assert a.token_ids == b.token_ids and a.prompt_token_ids == b.prompt_token_ids
        for x, y in zip(rec_p.sampled_logits(a.request_id), rec_c.sampled_logits(b.request_id)):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
