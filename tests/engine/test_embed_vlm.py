"""Embedding requests with images on tiny random Qwen2.5-VL and Qwen3-VL (the stack of
Qwen3-VL-Embedding, DeepStack included): ``LLM.embed`` of a chat prompt with an image equals
the HF model's final hidden states (after the final norm) for the same processed input
("last" and "mean"), and different images give different vectors."""

from __future__ import annotations

import pytest
import torch

from helpers import CPU_FP32, IMAGES, SMALL, conv, drop_unused, hf_inputs
from tiny_vlms import QWEN3_VL_PIX, build_tiny_qwen3_vl
from atlas_vlm import LLM, PoolingParams, SamplingParams

pytestmark = pytest.mark.vlm


@pytest.fixture(scope="module")
def vl(tiny_models):
    folder, hf = tiny_models["qwen2_5_vl"]
    return folder, hf.eval()


@pytest.fixture(scope="module")
def llm(vl):
    return LLM(str(vl[0]), max_model_len=1024, num_kvcache_blocks=128, kvcache_block_size=16, **CPU_FP32)


def chat_prompt(image: str, text: str) -> dict:
    return {"messages": conv(IMAGES / image, text=text), "mm_options": SMALL}


@torch.no_grad()
def hf_hidden(hf, llm, prompt) -> torch.Tensor:
    """HF final hidden states ``[n, hidden]`` of the prompt as our engine processes it."""
    p = llm.engine.process_prompt(prompt)
    kwargs = drop_unused(hf, hf_inputs(p))
    return hf.model(**kwargs).last_hidden_state[0].float()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_image_embedding_equals_hf(llm, vl, pooling):
    prompts = [chat_prompt("chelsea.png", "Describe the cat."), chat_prompt("coffee.png", "A cup.")]
    outs = llm.embed(prompts, PoolingParams(pooling=pooling, normalize=False), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.error is None and out.finish_reason == "stop"
        ref = hf_hidden(vl[1], llm, prompt)
        assert len(out.prompt_token_ids) == ref.shape[0]
        want = ref[-1] if pooling == "last" else ref.mean(dim=0)
        torch.testing.assert_close(torch.tensor(out.embedding), want, atol=1e-5, rtol=0)
    assert torch.tensor(outs[0].embedding).sub(torch.tensor(outs[1].embedding)).abs().max() > 1e-3


def test_image_embedding_chunked_and_mixed_with_generation(vl, llm):
    prompt = chat_prompt("chelsea.png", "Describe the cat.")
    (whole,) = llm.embed(prompt, PoolingParams(pooling="mean"), use_tqdm=False)
    chunked = LLM(str(vl[0]), max_model_len=1024, num_kvcache_blocks=128, kvcache_block_size=16,
                  max_num_batched_tokens=16, **CPU_FP32)  # the image's tokens split over steps
    gen = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    alone = chunked.generate(chat_prompt("coffee.png", "A cup."), gen, use_tqdm=False)
    mixed = chunked.generate([chat_prompt("coffee.png", "A cup."), prompt], [gen, PoolingParams(pooling="mean")],
                             use_tqdm=False)
    assert mixed[0].token_ids == alone[0].token_ids
    torch.testing.assert_close(torch.tensor(mixed[1].embedding), torch.tensor(whole.embedding), atol=1e-5, rtol=0)


def test_qwen3_vl_image_embedding_equals_hf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_qwen3_vl_embed")
    hf = build_tiny_qwen3_vl(folder).eval()
    q3 = LLM(str(folder), max_model_len=1024, num_kvcache_blocks=128, kvcache_block_size=16, **CPU_FP32)
    prompts = [{"messages": conv(IMAGES / img, text="A picture."), "mm_options": {"max_pixels": 64 * QWEN3_VL_PIX}}
               for img in ("chelsea.png", "grace_hopper.jpg")]
    outs = q3.embed(prompts, use_tqdm=False)  # last token, normalised (Qwen3-VL-Embedding's defaults)
    for prompt, out in zip(prompts, outs):
        want = torch.nn.functional.normalize(hf_hidden(hf, q3, prompt)[-1], dim=0)
        torch.testing.assert_close(torch.tensor(out.embedding), want, atol=1e-5, rtol=0)
    assert torch.tensor(outs[0].embedding).sub(torch.tensor(outs[1].embedding)).abs().max() > 1e-3

