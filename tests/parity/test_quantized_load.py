"""``quantization="int8" | "int4"`` at load (round to nearest) on tiny random Qwen2 / Llama /
Qwen3 models saved with ``save_pretrained``: the decoder's projections become quantized
modules (no dense copy), and the engine equals HF ``transformers`` run on the same
dequantized weights (reference path: logits within 1e-4, greedy tokens equal). The kernel
path equals its own definition: every call against ``kernel_reference`` on the same input,
and the engine run again with ``kernel_reference`` as every quantized linear's forward
(logits within 1e-4, tokens equal, up to an activation that rounds the other way at a tie:
then the steps before it). It stays within a stated bound of the reference path (its int8
activations differ from the reference's fp32 ones, so greedy tokens may part at a near-tie).
Unknown schemes and checkpoint quantization methods are refused by name."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from helpers import require_quant_kernel
from quant_checks import (KERNEL_CALL_REL, KERNEL_DEFINITION_ATOL, QuantCalls, as_kernel_definition,
                          steps_before_rounding_tie)
from torch import nn

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.layers import quant_linear
from atlas_vlm.layers.quant_linear import Int4Linear, Int8Linear, quantized_modules
from atlas_vlm.quantization import UnsupportedQuantizationError

pytestmark = pytest.mark.text

FAMILIES = ("qwen2", "llama", "qwen3")
N_TOKENS = 8
# kernel vs reference path at the first step: max |diff| / max |logit| of the reference run
# (measured 1.2e-2 .. 1.9e-2 over the six cases; later steps may follow other tokens)
KERNEL_LOGITS_REL = 3e-2


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 150000, (n,), generator=g).tolist()


def run(llm: LLM, ids: list[int]):
    logits = []

    def observe(chunks, inp, lg, sampled):
        logits.append(lg[0].detach().clone())

    llm.engine.runner.observers.append(observe)
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    llm.engine.runner.observers.remove(observe)
    return out.token_ids, torch.stack(logits)


def load(folder, method, kernel: bool, monkeypatch) -> LLM:
    monkeypatch.setattr(quant_linear, "quant_kernel_available", lambda *a, **k: kernel)
    return LLM(str(folder), quantization=method, max_model_len=256, num_kvcache_blocks=16, dtype="float32")


def hf_dequantized(hf, model, layers=lambda m: m.model.layers):
    """A copy of the HF model with every decoder projection replaced by our dequantized weight
    (``layers``: the HF decoder layers of a model)."""
    hf = copy.deepcopy(hf)
    arch = model.arch
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    with torch.no_grad():
        for ours, theirs in zip(model.model.layers, layers(hf)):
            wq, wk, wv = ours.self_attn.qkv_proj.dequantize().split([q, kv, kv])
            theirs.self_attn.q_proj.weight.copy_(wq)
            theirs.self_attn.k_proj.weight.copy_(wk)
            theirs.self_attn.v_proj.weight.copy_(wv)
            theirs.self_attn.o_proj.weight.copy_(ours.self_attn.o_proj.dequantize())
            gate, up = ours.mlp.gate_up_proj.dequantize().split(arch.intermediate_size)
            theirs.mlp.gate_proj.weight.copy_(gate)
            theirs.mlp.up_proj.weight.copy_(up)
            theirs.mlp.down_proj.weight.copy_(ours.mlp.down_proj.dequantize())
    return hf


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_at_load_equals_hf_on_dequantized_weights(family, method, tiny_models, monkeypatch):
    folder, hf = tiny_models[family]
    ref = load(folder, method, False, monkeypatch)
    model = ref.engine.runner.model
    mods = quantized_modules(model)
    cls = Int8Linear if method == "int8" else Int4Linear
    assert len(mods) == 4 * hf.config.num_hidden_layers and all(isinstance(m, cls) and not m.use_kernel for m in mods)
    assert not any(isinstance(m, nn.Linear) for m in model.model.layers.modules())  # no dense projection left
    if method == "int4":
        # the stated group: 128 where it divides in_features (128), else 64 (64) or 32 (Qwen3's 96)
        assert all(m.group_size == {128: 128, 64: 64, 96: 32}[m.in_features] for m in mods)
    dense_bytes = sum(m.in_features * m.out_features * 4 for m in mods)
    assert sum(m.weight_bytes() for m in mods) < dense_bytes / (3 if method == "int8" else 5)
    ids = prompt(12, seed=3)
    tokens, logits = run(ref, ids)
    hfq = hf_dequantized(hf, model)
    with torch.no_grad():
        first = hfq(torch.tensor([ids])).logits[0, -1].float()
        gen = hfq.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=151643)
    torch.testing.assert_close(logits[0], first, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits, torch.stack([s[0].float() for s in gen.logits]), atol=1e-4, rtol=0)
    assert tokens == gen.sequences[0, len(ids):].tolist()
    # quantization changed the model (the dense engine answers differently)
    assert (first - hf(torch.tensor([ids])).logits[0, -1].float()).abs().max() > 1e-3

    require_quant_kernel("the kernel half (the reference half above passed)")
    ker = load(folder, method, True, monkeypatch)
    assert all(m.use_kernel for m in quantized_modules(ker.engine.runner.model))
    with QuantCalls(ker, check=True) as k_calls:
        k_tokens, k_logits = run(ker, ids)
    assert k_calls.worst_rel <= KERNEL_CALL_REL, k_calls.worst_rel  # each call vs its definition (measured <= 6.6e-7)
    rel = ((k_logits[:1] - logits[:1]).abs().max() / logits.abs().max()).item()
    assert rel <= KERNEL_LOGITS_REL, rel
    as_kernel_definition(monkeypatch)
    defn = load(folder, method, True, monkeypatch)
    with QuantCalls(defn, check=False) as d_calls:
        d_tokens, d_logits = run(defn, ids)
    n = steps_before_rounding_tie(k_calls, d_calls)  # measured: all 8 steps in the six cases
    # measured max |diff| 2.4e-7 .. 2.2e-6 (fp32 summation order only; AVX-512 and AVX2 ATen).
    # Kernel tokens equal the reference path's in 5 of the six cases (qwen2 int4: 1 of 8, a
    # near-tie at the second token): why the check is against the kernel's definition
    torch.testing.assert_close(k_logits[:n], d_logits[:n], atol=KERNEL_DEFINITION_ATOL, rtol=0)
    assert k_tokens[:n] == d_tokens[:n]


def test_unknown_scheme_is_refused_by_name(tiny_models):
    with pytest.raises(UnsupportedQuantizationError, match="'fp8'"):
        LLM(str(tiny_models["qwen2"][0]), quantization="fp8")


def test_checkpoint_quant_method_unsupported_is_refused_by_name(tiny_models, tmp_path):
    import shutil

    src = tiny_models["qwen2"][0]
    dst = tmp_path / "bnb"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedQuantizationError, match="'bitsandbytes'"):
        LLM(str(dst), dtype="float32")
    with pytest.raises(UnsupportedQuantizationError, match="needs a checkpoint with a quantization_config"):
        LLM(str(src), quantization="awq", dtype="float32")
    with pytest.raises(UnsupportedQuantizationError, match="needs a .gguf file"):
        LLM(str(src), quantization="gguf", dtype="float32")
