"""The Triton quantized matmuls (``kernels/triton_quant``) against their PyTorch references:
GGUF blocks as stored (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K) against gguf-py's ``dequantize`` +
``F.linear``, ``Int8Linear`` / ``Int4Linear`` tiles against ``forward_reference``; the split-K
GEMV (1-8 rows, one or several K slices) and the tiled GEMM (16-40 rows); fp32 to 1e-5 of
``|x| @ |W|.T``, fp16 / bf16 to 2e-2 of it. The choice (CUDA -> Triton, CPU -> as before) with
the device faked, and a tiny int4 model's greedy tokens with the Triton path forced.
Small shapes and few examples: on CPU the interpreter runs every program in numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEVICE
from atlas_vlm.kernels import triton_quant
from atlas_vlm.kernels.triton_quant import (GEMV_MAX_ROWS, gguf_matmul_reference, gguf_matmul_triton,
                                            quant_matmul_triton)
from atlas_vlm.layers import quant_linear
from atlas_vlm.layers.quant_linear import Int4Linear, Int8Linear

pytestmark = [pytest.mark.text, pytest.mark.triton]

G = GGMLQuantizationType
QTYPES = [G.Q4_0, G.Q8_0, G.Q4_K, G.Q5_K, G.Q6_K]
HALF_AT = {G.Q4_0: (0,), G.Q8_0: (0,), G.Q4_K: (0, 2), G.Q5_K: (0, 2), G.Q6_K: (208,)}  # fp16 fields' offsets
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}
FEW = settings(max_examples=15, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
rows = st.one_of(st.integers(1, 8), st.integers(16, 40))  # GEMV rows, GEMM rows


def random_blocks(qtype: G, n: int, k: int, seed: int) -> torch.Tensor:
    """``[n, k]`` in ``qtype``: random bytes, the fp16 scale fields set to small finite values."""
    values, nbytes = quants.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n * k // values, nbytes), dtype=np.uint8)
    for at in HALF_AT[qtype]:
        b[:, at:at + 2] = (rng.standard_normal((b.shape[0], 1)) * 0.02).astype(np.float16).view(np.uint8)
    return torch.from_numpy(b.reshape(n, -1)).to(DEVICE)


def assert_close(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype):
    """``|out - ref| <= tol * (|x| @ |w|.T) + tol`` elementwise (fp32 comparison)."""
    bound = TOL[dtype] * (x.float().abs() @ w.float().abs().T + 1)
    err = (out.float() - ref.float()).abs()
    assert out.dtype == dtype and out.shape == ref.shape
    assert bool((err <= bound).all()), f"max error {err.max().item()} over bound {(err - bound).max().item()}"


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_gguf_weights_dequantized_bit_for_bit(qtype):
    # x = I: every output is one product W[n, k] * 1 (plus zeros), so the GEMM returns W.T exactly
    k = quants.GGML_QUANT_SIZES[qtype][0]
    blocks = random_blocks(qtype, 5, k, 0)
    w = quants.dequantize(blocks.cpu().numpy(), qtype)  # [5, k] fp32
    out = gguf_matmul_triton(torch.eye(k, device=DEVICE), blocks, qtype, 5, k)
    assert torch.equal(out.T.cpu(), torch.from_numpy(w))


@FEW
@given(qtype=st.sampled_from(QTYPES), m=rows, n=st.integers(1, 40), kblocks=st.integers(1, 2),
       dtype=st.sampled_from(list(DTYPES)), split_k=st.sampled_from([None, 2]), seed=st.integers(0, 2 ** 16))
def test_gguf_matmul_matches_the_reference(qtype, m, n, kblocks, dtype, split_k, seed):
    dtype = DTYPES[dtype]
    values = quants.GGML_QUANT_SIZES[qtype][0]
    k = kblocks * values if values == 256 else kblocks * 64
    blocks = random_blocks(qtype, n, k, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)
    ref = gguf_matmul_reference(x, blocks, qtype, n, k)
    w = torch.from_numpy(quants.dequantize(blocks.cpu().numpy(), qtype)).to(DEVICE)
    if split_k is None:
        out = gguf_matmul_triton(x, blocks, qtype, n, k)
    else:  # the GEMV's K slices, forced
        out = quant_matmul_triton(x, int(qtype), blocks, None, None, n, k, 1, split_k=split_k)
    assert_close(out, ref, x, w, dtype)


def quantized_layer(kind: str, n: int, k: int, group: int, bias: bool, seed: int):
    """A random ``Int8Linear`` (``int8``, ``int8_min`` with mins) or ``Int4Linear``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if kind == "int4":
        m = Int4Linear(k, n, bias, group)
        m.load_dense_rows(0, w)
    else:
        m = Int8Linear(k, n, bias, group, has_min=kind == "int8_min")
        q, scales = quant_linear.quantize_int8_rtn(w, group)
        m.load_rows(0, q, scales, torch.randn(scales.shape, generator=g) if kind == "int8_min" else None)
    if bias:
        m.bias.data.copy_(torch.randn(n, generator=g))
    m.finalize(use_kernel=False)
    return m.to(DEVICE)


@FEW
@given(kind=st.sampled_from(["int8", "int8_min", "int4"]), m=rows, n=st.integers(1, 40),
       k_group=st.sampled_from([(64, 32), (64, 64), (128, 32), (96, 16)]), bias=st.booleans(),
       dtype=st.sampled_from(list(DTYPES)), seed=st.integers(0, 2 ** 16))
def test_int8_int4_tiles_match_the_reference(kind, m, n, k_group, bias, dtype, seed):
    k, group = k_group
    dtype = DTYPES[dtype]
    layer = quantized_layer(kind, n, k, group, bias, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(DEVICE)
    out = triton_quant.quant_linear_triton(x, layer.qweight, layer.scales, layer._mins(), n, group, layer.bias)
    assert_close(out, layer.forward_reference(x), x, layer.dequantize(), dtype)


def test_triton_chosen_on_cuda_only(monkeypatch):
    assert quant_linear.triton_quant_available("cuda") and not quant_linear.triton_quant_available("cpu")
    layer = quantized_layer("int4", 24, 64, 32, True, 1)
    x = torch.randn(3, 2, 64, device=DEVICE)
    calls = []
    real = triton_quant.quant_linear_triton
    monkeypatch.setattr(triton_quant, "quant_linear_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    if DEVICE == "cpu":  # CPU: unchanged (the C kernel or the reference), Triton never called
        assert torch.equal(layer(x), layer.forward_reference(x)) and not calls
        monkeypatch.setattr(quant_linear, "triton_quant_available", lambda device: True)  # fake a CUDA device
    out = layer(x)
    assert calls and out.shape == (3, 2, 24)
    assert_close(out.view(6, 24), layer.forward_reference(x).view(6, 24), x.view(6, 64), layer.dequantize(),
                 torch.float32)


def test_bad_inputs_are_named():
    blocks = random_blocks(G.Q8_0, 4, 64, 0)
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="qtype"):
        gguf_matmul_triton(x, blocks, G.Q2_K, 4, 64)
    with pytest.raises(ValueError, match="blocks must be uint8 holding 272 bytes"):
        gguf_matmul_triton(x, blocks[:, :-1], G.Q8_0, 4, 64)
    with pytest.raises(ValueError, match="not a multiple"):
        gguf_matmul_triton(x[:, :48], blocks, G.Q8_0, 4, 48)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        gguf_matmul_triton(x[:, :32], blocks, G.Q8_0, 4, 64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine on CPU tensors needs the interpreter")
def test_engine_int4_greedy_tokens_with_triton_forced(tiny_models, monkeypatch):
    """A tiny int4 model (round to nearest at load) gives the same greedy tokens with every
    quantized linear through the Triton kernels (CUDA faked) as through the PyTorch reference."""
    from helpers import CPU_FP32
    from atlas_vlm import LLM, SamplingParams

    folder = str(tiny_models["qwen3"][0])
    prompts = [[(7 * i + j) % 5000 + 10 for j in range(n)] for i, n in enumerate([2, 9])]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    calls = []
    real = triton_quant.quant_linear_triton
    monkeypatch.setattr(triton_quant, "quant_linear_triton", lambda *a, **kw: calls.append(a[0].shape[0]) or
                        real(*a, **kw))
    tokens = {}
    for faked_cuda in (False, True):
        monkeypatch.setattr(quant_linear, "quant_kernel_available", lambda *a, **kw: False)
        monkeypatch.setattr(quant_linear, "triton_quant_available", lambda device: faked_cuda)
        llm = LLM(folder, quantization="int4", max_model_len=64, num_kvcache_blocks=16, **CPU_FP32)
        tokens[faked_cuda] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[True] == tokens[False] and all(len(t) == 2 for t in tokens[True])
    assert max(calls) > GEMV_MAX_ROWS and min(calls) <= GEMV_MAX_ROWS  # both kernels ran


COMPILE_FOR_H100 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from atlas_vlm.kernels import triton_quant as tq
from atlas_vlm.kernels.triton_quant_formats import GGUF_BLOCK, INT4, INT8, INT8_MIN

for fmt in (INT8, INT8_MIN, INT4, *GGUF_BLOCK):
    for kern, x, consts in ((tq._gemm_kernel, "*bf16", dict(FP32_DOT=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)),
                            (tq._gemv_kernel, "*fp32", dict(BLOCK_M=8, BLOCK_N=32, BLOCK_K=64))):
        if kern is tq._gemv_kernel and fmt != INT4:
            continue
        consts.update(FMT=fmt, HAS_BIAS=True)
        types = dict(x_ptr=x, w_ptr="*i8" if fmt in (INT8, INT8_MIN) else "*u8", s_ptr="*fp16", m_ptr="*fp16",
                     bias_ptr=x, out_ptr=x)
        sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in kern.arg_names}
        assert "cubin" in triton.compile(ASTSource(kern, sig, consts), target=GPUTarget("cuda", 90, 32)).asm
print("compiled")
"""


def test_kernels_compile_for_an_h100_without_one(tmp_path):
    """The interpreter runs Python, not Triton's compiler: compile every format's GEMM (and the int4
    GEMV) to an sm_90 cubin, which needs no GPU, in a process without
    ``TRITON_INTERPRET`` (compiled Triton refuses what the interpreter lets pass, e.g.
    non-constexpr globals)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_H100], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
