"""Quantization at load on a VLM (tiny random Qwen2.5-VL): the decoder's projections are
quantized, the vision tower stays dense, and an image prompt gives HF's tokens and logits
(1e-4) on the same dequantized decoder weights (reference path). The kernel path equals its
own definition as in tests/parity/test_quantized_load.py (every call against
``kernel_reference``; the engine run again through it, up to an activation rounding tie) and
stays within that file's bound of the reference path at the first step."""

from __future__ import annotations

import pytest
import torch

from helpers import IMAGES, SMALL, assert_matches_hf, chat, conv, require_quant_kernel
from quant_checks import (KERNEL_CALL_REL, KERNEL_DEFINITION_ATOL, QuantCalls, as_kernel_definition,
                          steps_before_rounding_tie)
from atlas_vlm import LLM
from atlas_vlm.layers import quant_linear
from atlas_vlm.layers.quant_linear import quantized_modules

pytestmark = pytest.mark.vlm

N_TOKENS = 6


def _load(folder, method, kernel: bool, monkeypatch) -> LLM:
    monkeypatch.setattr(quant_linear, "quant_kernel_available", lambda *a, **k: kernel)
    llm = LLM(str(folder), quantization=method, dtype="float32", max_model_len=2048, num_kvcache_blocks=64)
    assert all(m.use_kernel == kernel for m in quantized_modules(llm.engine.runner.model))
    return llm


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_vlm_decoder_equals_hf_on_dequantized_weights(method, tiny_models, monkeypatch):
    from test_quantized_load import KERNEL_LOGITS_REL, hf_dequantized

    folder, hf = tiny_models["qwen2_5_vl"]
    llm = _load(folder, method, False, monkeypatch)
    model = llm.engine.runner.model
    assert len(quantized_modules(model)) == 4 * 2
    assert not quantized_modules(llm.engine.runner.vision.model if hasattr(llm.engine.runner.vision, "model")
                                 else llm.engine.runner.vision)  # the tower stays dense
    ref = hf_dequantized(hf, model, layers=lambda m: m.model.language_model.layers)
    c = conv(IMAGES / "chelsea.png", text="Describe this image.")
    outs, rec = chat(llm, [c], N_TOKENS, mm_options=SMALL)
    assert_matches_hf(llm, ref, c, outs[0], rec, N_TOKENS, mm_options=SMALL)
    first = rec.first_logits(outs[0].request_id)

    require_quant_kernel("the kernel half (the reference half above passed)")
    runs = []
    for definition in (False, True):  # the kernel, then its definition (kernel_reference) as the forward
        if definition:
            as_kernel_definition(monkeypatch)
        ker = _load(folder, method, True, monkeypatch)
        with QuantCalls(ker, check=not definition) as calls:
            k_outs, k_rec = chat(ker, [c], N_TOKENS, mm_options=SMALL)
        logits = torch.stack(k_rec.sampled_logits(k_outs[0].request_id))
        assert len(calls.step_ends) == len(logits) == N_TOKENS  # one prefill chunk, then decode steps
        runs.append((calls, k_outs[0].token_ids, logits))
    (k_calls, k_tokens, k_logits), (d_calls, d_tokens, d_logits) = runs
    assert k_calls.worst_rel <= KERNEL_CALL_REL, k_calls.worst_rel  # measured <= 4.6e-7
    rel = ((k_logits[0] - first).abs().max() / first.abs().max()).item()
    assert rel <= KERNEL_LOGITS_REL, rel  # measured 1.2e-2 (int8 and int4)
    n = steps_before_rounding_tie(k_calls, d_calls)  # measured: all 6 steps (int8 and int4)
    # measured max |diff| 1.1e-6 / 1.2e-6 (fp32 summation order only); kernel tokens = reference's, 6/6
    torch.testing.assert_close(k_logits[:n], d_logits[:n], atol=KERNEL_DEFINITION_ATOL, rtol=0)
    assert k_tokens[:n] == d_tokens[:n]
