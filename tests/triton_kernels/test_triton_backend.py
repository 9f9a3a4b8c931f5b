"""The ``"triton"`` attention backend chosen by capability (the device faked: no GPU needed)
and the engine end to end with it forced on CPU tensors under the interpreter: the same greedy
tokens as the ``"reference"`` backend on a tiny random model."""

from __future__ import annotations

import builtins

import pytest
import torch

from helpers import CPU_FP32
from atlas_vlm import LLM, SamplingParams
from atlas_vlm.layers.attention import resolve_attention_backend

pytestmark = [pytest.mark.text, pytest.mark.triton]

ARGS = (torch.bfloat16, 8, 2, 128)  # dtype, heads, kv heads, head_dim


def test_auto_picks_triton_on_cuda():
    assert resolve_attention_backend("auto", "cuda", *ARGS) == "triton"
    assert resolve_attention_backend("auto", torch.device("cuda", 1), *ARGS) == "triton"
    for kv_cache_dtype in ("int8", "fp8_e4m3"):  # 8-bit KV read by the kernel (test_triton_kv8)
        assert resolve_attention_backend("auto", "cuda", *ARGS, kv_cache_dtype=kv_cache_dtype) == "triton"


def test_auto_on_cuda_keeps_bucketed_where_triton_cannot_serve(monkeypatch):
    real_import = builtins.__import__

    def no_triton(name, *args, **kwargs):
        if name == "atlas_vlm.kernels" and "triton_attention" in (args[2] or ()):
            raise ImportError("No module named 'triton'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    assert resolve_attention_backend("auto", "cuda", *ARGS) == "bucketed"
    with pytest.raises(ValueError, match="triton does not import"):
        resolve_attention_backend("triton", "cuda", *ARGS)


def test_auto_on_cpu_is_unchanged():
    assert resolve_attention_backend("auto", "cpu", torch.float16, 8, 2, 128) == "bucketed"
    assert resolve_attention_backend("auto", "cpu", *ARGS) in ("decode_kernel", "bucketed")


def test_forced_triton_names_why_it_cannot_serve(monkeypatch):
    with pytest.raises(ValueError, match="attention_backend='triton'.*kv_cache_dtype='fp4'"):
        resolve_attention_backend("triton", "cuda", *ARGS, kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="head_dim 512"):
        resolve_attention_backend("triton", "cuda", torch.float32, 8, 2, 512)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read again at each call
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", "cpu", *ARGS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine on CPU tensors needs the interpreter")
@pytest.mark.parametrize("family, kind", [("qwen3", "paged")])  # contiguous: test_triton_kernels
def test_engine_greedy_tokens_match_the_reference(tiny_models, family, kind):
    """Mixed prompt lengths, chunked prefill next to decodes (16-token steps); qwen3's head_dim
    24 is padded to 32 in the kernel."""
    folder = str(tiny_models[family][0])
    prompts = [[(7 * i + j) % 5000 + 10 for j in range(n)] for i, n in enumerate([3, 21, 9])]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for backend in ("reference", "triton"):
        llm = LLM(folder, kv_cache=kind, max_model_len=64, num_kvcache_blocks=16 if kind == "paged" else 4,
                  max_num_batched_tokens=16, attention_backend=backend, **CPU_FP32)
        assert llm.engine.runner.attention_backend == backend
        tokens[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton"] == tokens["reference"] and all(len(t) == 4 for t in tokens["triton"])
