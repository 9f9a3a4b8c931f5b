"""LoRA over other bases: a VLM family with an image (Qwen2-VL, fp32 logits against PEFT's
merged model), and quantized bases (an int8 engine; a GGUF Q8_0 layer): the adapter's delta
is added to whatever the base layer returns, so each wrapped layer's output is the base
layer's plus the adapter's low-rank products, row by row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atlas_vlm import LLM, LoRARequest
from atlas_vlm.layers.quant_linear import Int8Linear
from atlas_vlm.lora.layers import LoRALinear, PunicaBatch
from helpers import CPU_FP32, IMAGES, conv, drop_unused, greedy, hf_inputs, record
from lora_helpers import engine_run, make_adapter, merged_model

ATOL = 1e-5


@pytest.mark.vlm
def test_vlm_with_image_matches_peft_merged(tiny_models, tmp_path):
    folder, hf = tiny_models["qwen2_vl"]
    adapter = make_adapter(hf, tmp_path / "vl", 30, r=8)
    merged = merged_model(hf, adapter)
    llm = LLM(str(folder), enable_lora=True, max_loras=2, max_lora_rank=8, max_pixels=64 * 28 * 28, **CPU_FP32)
    c = conv(IMAGES / "aspect_200.png", text="What is in the image?")
    with record(llm) as rec:
        out = llm.chat(c, greedy(3), lora_request=LoRARequest("vl", 1, str(adapter)), use_tqdm=False)[0]
    p = llm.engine.process_prompt({"messages": c})
    kwargs = drop_unused(merged, hf_inputs(p))
    with torch.no_grad():
        ref = merged(**kwargs).logits[0, -1].float()
        base = hf(**kwargs).logits[0, -1].float()
    ours = rec.first_logits(out.request_id)
    assert (ours - ref).abs().max() < ATOL, (ours - ref).abs().max().item()
    assert (ours - base).abs().max() > 1e-2  # the adapter reaches the language model
    gen = merged.generate(**kwargs, max_new_tokens=3, do_sample=False, pad_token_id=151643)
    assert out.token_ids == gen[0, kwargs["input_ids"].shape[1]:].tolist()


def _expected(base_out, x, slots, adapters, module_rows):
    """``base_out`` plus each row's adapter delta from the adapter files (fp64)."""
    want = base_out.double().clone()
    for row, s in enumerate(slots):
        if s < 0:
            continue
        off = 0
        for a, b, scaling in adapters[s]:
            delta = (x[row].double() @ a.double().T) @ b.double().T * scaling
            want[row, off:off + b.shape[0]] += delta
            off += b.shape[0]
    return want


def _random_pairs(gen, in_f, sizes, r):
    return [(torch.randn(r, in_f, generator=gen) * 0.1, torch.randn(o, r, generator=gen) * 0.1) for o in sizes]


@pytest.mark.text
@pytest.mark.parametrize("kind", ["int8", "gguf_q8_0"])
@pytest.mark.parametrize("slots", [[0, -1, 2, 2, 0, -1, 2], [0, 1, 2, -1, 1, 0, 2]])
def test_wrapper_adds_delta_over_quantized_layer(kind, slots):
    """Rows of two adapters and none (a gather per group), or of three (one shrink over every
    slot, masked), through one ``LoRALinear`` over an int8 / GGUF Q8_0 layer."""
    gen = torch.Generator().manual_seed(0)
    in_f, sizes = 256, [64, 32, 32]  # a fused q/k/v of three projections
    w = torch.randn(sum(sizes), in_f, generator=gen)
    if kind == "int8":
        base = Int8Linear(in_f, sum(sizes))
        base.load_dense_rows(0, w)
    else:
        from gguf import GGMLQuantizationType, quants

        from atlas_vlm.layers.gguf_linear import GGUFLinear

        blocks = torch.from_numpy(quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0).astype(np.uint8))
        base = GGUFLinear(blocks.view(sum(sizes), -1), "Q8_0", in_f, sum(sizes))
    punica = PunicaBatch(3)
    layer = LoRALinear(base, sizes, 3, 8, punica, torch.float32, torch.device("cpu"))
    adapters = {0: _random_pairs(gen, in_f, sizes, 8), 1: _random_pairs(gen, in_f, sizes, 2),
                2: _random_pairs(gen, in_f, sizes, 4)}
    adapters[2][1] = None  # not targeting k
    for slot, pairs in adapters.items():
        layer.set_slot(slot, pairs, 0.5)
    x = torch.randn(7, in_f, generator=gen)
    punica.set(slots)
    assert (punica.mask is not None) == (len(set(slots) - {-1}) >= 3)
    got = layer(x)
    punica.clear()
    base_out = base(x)
    zero = (torch.zeros(0, in_f), torch.zeros(sizes[1], 0))
    refs = {s: [(a, b, 0.5) for a, b in (p if p is not None else zero for p in pairs)] for s, pairs in adapters.items()}
    assert torch.allclose(got.double(), _expected(base_out, x, slots, refs, sizes), atol=1e-4, rtol=1e-5)
    none = [i for i, s in enumerate(slots) if s < 0]
    assert torch.equal(got[none], base_out[none])  # rows without an adapter: the base layer's bits


@pytest.mark.text
def test_int8_engine_mixed_batch_equals_alone(tiny_models, tmp_path):
    folder, hf = tiny_models["qwen2"]
    adapters = [make_adapter(hf, tmp_path / f"q{i}", 40 + i, r=4) for i in range(2)]
    llm = LLM(str(folder), quantization="int8", enable_lora=True, max_loras=2, max_lora_rank=8, **CPU_FP32)
    loras = [LoRARequest(f"q{i}", i + 1, str(p)) for i, p in enumerate(adapters)] + [None]
    prompts = [[9707, 11, 1879, 0, 358], [3838, 374, 279, 6722], [40, 2948, 311, 1486, 264]]
    together = engine_run(llm, prompts, 4, loras)
    for prompt, lora, (ids, logits) in zip(prompts, loras, together):
        [(ids_alone, logits_alone)] = engine_run(llm, [prompt], 4, lora)
        assert ids == ids_alone and torch.allclose(logits, logits_alone, atol=ATOL, rtol=0)
    assert type(llm.engine.runner.lora.layers[0]["qkv_proj"].base_layer).__name__ == "Int8Linear"
    assert together[0][0] != engine_run(llm, [prompts[0]], 4, None)[0][0]  # the adapter changes the answer
