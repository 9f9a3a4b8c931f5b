"""bf16 linear layers over oneDNN-packed weights (``atlas_vlm.layers.linear``): the same
bits as ``nn.Linear`` for any number of rows, the same greedy tokens and logprobs from the
engine, and the engine packs exactly its decoder's linear layers when the CPU can. On a CPU
without oneDNN's bf16 path (an AVX2-only x86, detected or faked) the engine keeps nn.Linear
and runs bf16 all the same; only the tests that call the packed op itself skip there."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import IMAGES, conv
from atlas_vlm import LLM, SamplingParams, hardware
from atlas_vlm.hardware import CpuFeatures
from atlas_vlm.layers.linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.text
PACKS = can_pack(torch.bfloat16, "cpu")
needs_onednn_bf16 = pytest.mark.skipif(
    not PACKS, reason="oneDNN's bf16 path needs AVX512-BW/VL/DQ, AVX-NE-CONVERT or AMX (x86) or BF16 (aarch64): "
                      f"this CPU is {hardware.cpu_features().describe()}")
AVX2_ONLY = CpuFeatures(frozenset({"avx", "avx2", "fma", "f16c"}), "x86_64")


def test_can_pack_only_bf16_on_a_cpu_with_onednn():
    assert can_pack(torch.bfloat16, "cpu") == (torch.backends.mkldnn.is_available()
                                               and hardware.cpu_features().onednn_bf16)
    assert not can_pack(torch.float32, "cpu")
    assert not can_pack(torch.bfloat16, "cuda")


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (300, 96), (2, 5, 96)])
def test_packed_linear_gives_nn_linear_bits(shape, bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    x = torch.randn(shape).to(torch.bfloat16)
    packed = PackedLinear(lin)
    with torch.inference_mode():
        out, ref = packed(x), lin(x)
    assert out.shape == (*shape[:-1], 200) and out.dtype == torch.bfloat16
    assert torch.equal(out, ref)


def test_packed_linear_refuses_fp32():
    with pytest.raises(ValueError, match="bf16"):
        PackedLinear(nn.Linear(4, 4))


@needs_onednn_bf16
def test_pack_linears_replaces_bf16_linears_only():
    net = nn.Sequential(nn.Linear(8, 8).bfloat16(), nn.ReLU(), nn.Sequential(nn.Linear(8, 4).bfloat16()),
                        nn.Linear(4, 4))
    assert pack_linears(net) == 2
    assert [type(m).__name__ for m in (net[0], net[2][0], net[3])] == ["PackedLinear", "PackedLinear", "Linear"]


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # untied and tied LM head
def test_engine_packs_its_decoder_and_decodes_the_same_bits(tiny_models, monkeypatch, family):
    folder, hf = tiny_models[family]
    prompts = [[151643, 9707, 11, 1879, 0], [151644, 100, 200, 300, 400, 500, 600, 700, 800]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    packed = LLM(str(folder), dtype="bfloat16", device="cpu", max_model_len=64, num_kvcache_blocks=16)
    layers = hf.config.num_hidden_layers
    assert packed.engine.runner.num_packed_linears == (4 * layers + 1 if PACKS else 0)
    assert isinstance(packed.engine.runner.model.lm_head, PackedLinear) == PACKS
    monkeypatch.setattr(hardware, "cpu_features", lambda: AVX2_ONLY)  # as on an AVX2-only EPYC
    plain = LLM(str(folder), dtype="bfloat16", device="cpu", max_model_len=64, num_kvcache_blocks=16)
    assert plain.engine.runner.num_packed_linears == 0 and plain.engine.runner.dtype == torch.bfloat16
    ours = packed.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(ours, ref):
        assert a.token_ids == b.token_ids
        assert len(a.logprobs) == 12 and a.logprobs == b.logprobs  # every step's top-3 logprobs, bit for bit


@pytest.mark.vlm
def test_vision_tower_packed_gives_the_same_bits(tiny_models, monkeypatch):
    """Qwen2.5-VL in bf16: the decoder and the vision tower (every nn.Linear of the fast
    tower: patch embed, blocks' qkv/proj/fused gate-up/down, merger) packed; image + text
    greedy tokens and logprobs equal the unpacked engine's."""
    folder, hf = tiny_models["qwen2_5_vl"]
    messages = conv(IMAGES / "chelsea.png", text="Describe this image.")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    kwargs = dict(dtype="bfloat16", device="cpu", max_model_len=1024, num_kvcache_blocks=64)
    packed = LLM(str(folder), **kwargs)
    decoder = 4 * hf.config.text_config.num_hidden_layers + 1
    vision = 4 * hf.config.vision_config.depth + 1 + 2  # blocks' qkv/proj/gate-up/down, patch embed, merger
    assert packed.engine.runner.vision.tower_kind == "fast" and packed.engine.runner.num_packed_linears == ((decoder + vision) if PACKS else 0)
    monkeypatch.setattr(hardware, "cpu_features", lambda: AVX2_ONLY)
    plain = LLM(str(folder), **kwargs)
    assert plain.engine.runner.num_packed_linears == 0
    a = packed.chat(messages, params, use_tqdm=False)[0]
    b = plain.chat(messages, params, use_tqdm=False)[0]
    assert len(a.token_ids) == 8 and len(a.logprobs) == 8
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_bf16_without_bf16_hardware_runs_plain_and_says_so(tiny_models, monkeypatch, caplog):
    """On an AVX2-only CPU (faked): dtype="auto" is fp32; dtype="bfloat16" loads with plain
    linear layers, warns once that it is emulated, and decodes the same tokens as the packed
    (or plain) bf16 engine of this machine."""
    folder, _ = tiny_models["qwen2"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": [151643, 9707, 11, 1879, 0]}]
    here = LLM(str(folder), dtype="bfloat16", device="cpu", max_model_len=64, num_kvcache_blocks=16)
    monkeypatch.setattr(hardware, "cpu_features", lambda: AVX2_ONLY)
    assert LLM(str(folder), device="cpu", max_model_len=64, num_kvcache_blocks=16).engine.runner.dtype == torch.float32
    caplog.clear()
    with caplog.at_level("WARNING", logger="atlas_vlm.worker.model_runner"):
        avx2 = LLM(str(folder), dtype="bfloat16", device="cpu", max_model_len=64, num_kvcache_blocks=16)
    notes = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert len(notes) == 1 and "AVX2" in notes[0] and "float32" in notes[0]
    assert avx2.engine.runner.num_packed_linears == 0
    assert avx2.generate(prompt, params, use_tqdm=False)[0].token_ids == here.generate(prompt, params, use_tqdm=False)[0].token_ids
