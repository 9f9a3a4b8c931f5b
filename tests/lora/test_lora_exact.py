"""LoRA exactness: our engine with a PEFT adapter (fused q/k/v and gate/up, rank padded to the
slot's) against PEFT's merged model (``merge_and_unload``), fp32 logits within 1e-5; a batch
mixing 4 adapters and the base equals each request alone."""

from __future__ import annotations

import pytest
import torch

from atlas_vlm import LLM, LoRARequest
from helpers import CPU_FP32
from lora_helpers import engine_run, make_adapter, merged_model, reference_logits

pytestmark = pytest.mark.text
ATOL = 1e-5
PROMPTS = [[9707, 11, 1879, 0, 358, 1079, 264], [3838, 374, 279, 6722, 315], [40, 2948, 311, 1486, 264, 3364, 911,
                                                                                  264, 8251, 13, 358]]


@pytest.fixture(scope="module")
def qwen2_lora(tiny_models, tmp_path_factory):
    """(folder, HF model, [adapter dirs]): 4 adapters of different ranks / targets / scalings."""
    folder, hf = tiny_models["qwen2"]
    root = tmp_path_factory.mktemp("adapters")
    adapters = [make_adapter(hf, root / "a0", 0, r=8, alpha=16),
                make_adapter(hf, root / "a1", 1, r=4, alpha=8, targets=["q_proj", "v_proj"]),
                make_adapter(hf, root / "a2", 2, r=16, alpha=4, use_rslora=True),
                make_adapter(hf, root / "a3", 3, r=2, alpha=2, targets=["o_proj", "down_proj", "up_proj"])]
    return folder, hf, adapters


@pytest.fixture(scope="module")
def llm(qwen2_lora):
    return LLM(str(qwen2_lora[0]), enable_lora=True, max_loras=4, max_lora_rank=16, **CPU_FP32)


def test_logits_match_peft_merged(qwen2_lora, llm):
    """Each adapter: every sampled step's fp32 logits within 1e-5 of PEFT's merged model
    (the sequence our engine generated, teacher-forced through the merged HF model)."""
    _, hf, adapters = qwen2_lora
    for i, path in enumerate(adapters):
        merged = merged_model(hf, path)
        lora = LoRARequest(f"a{i}", i + 1, str(path))
        for prompt in PROMPTS[i % 2:i % 2 + 1]:
            [(ids, logits)] = engine_run(llm, [prompt], 4, lora)
            ref = reference_logits(merged, ids)[len(prompt) - 1:len(ids) - 1]  # [4, vocab]
            assert torch.allclose(logits, ref, atol=ATOL, rtol=0), (i, (logits - ref).abs().max().item())
            base = reference_logits(hf, ids)[len(prompt) - 1:len(ids) - 1]
            assert (logits - base).abs().max() > 1e-2  # the adapter changes the model


def test_mixed_batch_equals_each_alone(qwen2_lora, llm):
    """4 adapters and the base in one batch (rows of every adapter in the same steps) give the
    tokens and logits each request gets alone."""
    _, _, adapters = qwen2_lora
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)] + [None]
    prompts = [PROMPTS[i % 3] for i in range(5)]
    together = engine_run(llm, prompts, 5, loras)
    for prompt, lora, (ids, logits) in zip(prompts, loras, together):
        [(ids_alone, logits_alone)] = engine_run(llm, [prompt], 5, lora)
        assert ids == ids_alone
        assert torch.allclose(logits, logits_alone, atol=ATOL, rtol=0)
    assert len({tuple(ids) for ids, _ in together[:3]}) > 1  # the adapters answer differently
