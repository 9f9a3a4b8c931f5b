"""``kv_cache_dtype`` "int8" / "fp8_e4m3" through every attention path: the C decode kernel's
8-bit variant against the reference backend on the same stored codes (fp32 exact to 1e-5,
bf16 within its output rounding), the kernel faked absent (the engine falls back, same
tokens), the compiled step and the one-call C step declining an 8-bit cache by name, and
accuracy: on the tiny families greedy tokens equal ``auto`` KV or the first difference at a
near-tie; on the real SmolLM2-135M, teacher-forced top-1 agreement >= 99% and the logit error
bounded. The kernel's in-C Hadamard rotation of q and its output is checked against the gather
path at head_dim 64 / 128 / 24 / 80.
"""

from __future__ import annotations

import random

import pytest
import torch

from teacher_forcing import record_logits
from test_attention_backends import HEAD_DIM, HEADS, NUM_BLOCKS, random_step, run_both
from test_decode_kernel import needs_kernel
from atlas_vlm import LLM, SamplingParams
from atlas_vlm.kernels import decode_kernel
from atlas_vlm.layers.attention import resolve_attention_backend
from atlas_vlm.worker.compiled_decode import resolve_compile_decode
from mm_kv_cache_management import KVCacheSpec, PagedKVCache

pytestmark = pytest.mark.text
PROMPTS = ["The quick brown fox jumps over the lazy dog and then", "1, 2, 3, 4, 5,", "Hello, my name is"]


def filled_q8(dtype, kv_heads: int, kv_dtype: str, seed: int) -> PagedKVCache:
    """A cache whose layer 1 holds random K/V written through ``write`` (quantized)."""
    cache = PagedKVCache(KVCacheSpec(2, kv_heads, HEAD_DIM, dtype, kv_dtype), NUM_BLOCKS, 16)
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(NUM_BLOCKS * 16)
    cache.write(1, slots, torch.randn(len(slots), kv_heads, HEAD_DIM, generator=g) * 2,
                torch.randn(len(slots), kv_heads, HEAD_DIM, generator=g))
    return cache


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize("num_seqs, decode_share", [(24, 1.0), (12, 0.7)])
def test_8bit_kernel_equals_the_reference_fp32(kv_dtype, kv_heads, num_seqs, decode_share):
    q_lens, c_lens, slots, tables = random_step(random.Random(kv_heads), num_seqs, decode_share)
    results = run_both(filled_q8(torch.float32, kv_heads, kv_dtype, kv_heads), q_lens, c_lens, slots, tables, 3,
                       backends=("reference", "decode_kernel", "bucketed"))
    ref, ref_cache = results["reference"]
    for backend in ("decode_kernel", "bucketed"):
        out, cache = results[backend]
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        assert torch.equal(cache.k_cache, ref_cache.k_cache) and torch.equal(cache.v_scale, ref_cache.v_scale)


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(64, 9, 3), (128, 4, 2), (24, 4, 1), (80, 2, 2)])
def test_8bit_kernel_rotation_equals_the_gather_path_at_every_head_dim(kv_dtype, head_dim, heads, kv_heads):
    """The kernel rotates q and its output in C (a dense 16-wide Hadamard stage, then butterflies
    across runs: head_dim 64 / 128 take both, 24 / 80 blocks of 8 / 16); the gather path
    dequantizes and rotates back in PyTorch: the same attention in fp32 to 1e-5."""
    g = torch.Generator().manual_seed(head_dim)
    cache = PagedKVCache(KVCacheSpec(1, kv_heads, head_dim, torch.float32, kv_dtype), 12, 16)
    slots = torch.arange(12 * 16)
    cache.write(0, slots, *(torch.randn(2, len(slots), kv_heads, head_dim, generator=g) * 2))
    tables, lens = torch.randperm(12, generator=g).view(3, 4), torch.tensor([1, 37, 64])
    q = torch.randn(3, heads, head_dim, generator=g)
    k, v = cache.gather_kv_for_attention(0, tables, 64)  # [3, 64, kv_heads, head_dim], in the model's basis
    k, v = (x.repeat_interleave(heads // kv_heads, dim=2).transpose(1, 2) for x in (k, v))  # [3, heads, 64, hd]
    scores = (q.unsqueeze(2) @ k.transpose(2, 3)).squeeze(2) * head_dim ** -0.5  # [3, heads, 64]
    scores = scores.masked_fill(torch.arange(64) >= lens.view(3, 1, 1), float("-inf"))
    ref = (scores.softmax(-1).unsqueeze(2) @ v).squeeze(2)  # [3, heads, head_dim]
    out = decode_kernel.paged_decode_attention(q, *cache.layer_kv(0)[:2], tables, lens, head_dim ** -0.5,
                                               *cache.layer_kv(0)[2:], kv_cache_dtype=kv_dtype)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, magnitude", [(64, 1.0), (64, 1e-4), (24, 300.0), (128, 5.0)])
def test_int8_store_in_c_is_bit_identical_to_write(dtype, head_dim, magnitude):
    """The fused RoPE path stores int8 K/V through ``decode_kernel.store_int8`` (one C call):
    the same codes and scales, bit for bit, as ``PagedKVCache.write`` (and zero rows, tiny rows
    at the smallest scale, slots in any order); a slot outside the cache is refused."""
    g = torch.Generator().manual_seed(head_dim)
    spec = KVCacheSpec(2, 3, head_dim, dtype, "int8")
    ours, ref = PagedKVCache(spec, 10, 16), PagedKVCache(spec, 10, 16)
    slots = torch.randperm(160, generator=g)[:70]
    k, v = (torch.randn(2, 70, 3, head_dim, generator=g) * magnitude).to(dtype)
    k[5] = 0.0  # a zero row
    decode_kernel.store_int8(ours, 1, slots, k, v)
    ref.write(1, slots, k, v)
    for a, b in zip(ours.layer_kv(1), ref.layer_kv(1)):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.int8 else a.view(torch.int16),
                           b.view(torch.uint8) if b.dtype == torch.int8 else b.view(torch.int16))
    assert ours.k_cache[1].abs().sum() > 0 and torch.equal(ours.k_cache[0], ref.k_cache[0])  # layer 0 untouched
    with pytest.raises(RuntimeError, match="outside the cache"):
        decode_kernel.store_int8(ours, 1, torch.tensor([160]), k[:1], v[:1])


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_8bit_kernel_in_bf16_within_bf16_rounding(kv_dtype):
    q_lens, c_lens, slots, tables = random_step(random.Random(7), 16, 1.0)
    results = run_both(filled_q8(torch.bfloat16, 2, kv_dtype, 7), q_lens, c_lens, slots, tables, 7,
                       backends=("reference", "decode_kernel"))
    (ref, _), (ours, _) = results["reference"], results["decode_kernel"]
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), ref.float(), atol=3e-2, rtol=2e-2)


def test_paths_that_store_in_the_model_dtype_decline_an_8bit_cache():
    on, why = resolve_compile_decode(True, "cpu", "int8")
    assert on is False and "kv_cache_dtype=int8" in why
    fake_absent = decode_kernel.unsupported_reason("cpu", torch.float32, HEADS, 2, HEAD_DIM, "int8")
    assert fake_absent is None or "could not be built" in fake_absent


@pytest.fixture(scope="module")
def greedy_runs(tiny_models):
    """{(family, kv_dtype, backend): (tokens per prompt, logits per prompt)} on fp32 tiny models."""
    runs = {}
    for family in ("qwen2", "llama", "qwen3"):
        for kv_dtype, backend in (("auto", "auto"), ("int8", "auto"), ("int8", "reference")):
            runs[family, kv_dtype, backend] = _run(str(tiny_models[family][0]), kv_dtype, backend)
    return runs


def _run(model: str, kv_dtype: str, backend: str = "auto", forced: dict | None = None, n: int = 24,
         prompts=PROMPTS, **kwargs):
    """Greedy tokens and every sampled step's logits per prompt; ``forced``: {prompt ids: tokens}
    makes each step emit the given token (teacher forcing) while its own logits are recorded."""
    llm = LLM(model, dtype="float32", kv_cache_dtype=kv_dtype, attention_backend=backend, num_kvcache_blocks=96,
              max_model_len=512, **kwargs)
    logits = record_logits(llm, forced)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    keys = [tuple(o.prompt_token_ids) for o in outs]
    return [o.token_ids for o in outs], [logits[k] for k in keys], keys, llm.engine.runner


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_tiny_families_greedy_equal_or_first_difference_at_a_near_tie(greedy_runs, tiny_models, family):
    auto_tokens, auto_logits, keys, _ = greedy_runs[family, "auto", "auto"]
    q8_tokens, _, _, runner = greedy_runs[family, "int8", "auto"]
    assert greedy_runs[family, "int8", "reference"][0] == q8_tokens  # the kernel and the reference agree
    assert runner.attention_backend == ("decode_kernel" if decode_kernel.available("int8") else "bucketed")
    assert runner.decode_step is None and runner.compiled_decode is None
    forced = dict(zip(keys, auto_tokens))
    _, tf_logits, _, _ = _run(str(tiny_models[family][0]), "int8", forced=forced)  # int8 along auto's tokens
    for a_tokens, q_tokens, a_logits, q_logits in zip(auto_tokens, q8_tokens, auto_logits, tf_logits):
        errors = [(q - a).abs().max().item() for a, q in zip(a_logits, q_logits)]
        scale = torch.stack(a_logits).std().item()
        # random tiny models have flat logits (std 0.16 on qwen3); measured worst: 0.11 x std (qwen3,
        # head_dim 24), under 0.05 x std on qwen2 / llama
        assert max(errors) < 0.15 * scale, (max(errors), scale)
        if q_tokens == a_tokens:
            continue
        i = next(j for j, (x, y) in enumerate(zip(a_tokens, q_tokens)) if x != y)
        margin = (a_logits[i][a_tokens[i]] - a_logits[i][q_tokens[i]]).item()
        assert 0 <= margin <= 2 * errors[i], f"step {i}: auto margin {margin} is not within int8's error {errors[i]}"


def test_contiguous_int8_equals_paged_int8(greedy_runs, tiny_models):
    contiguous, *_ = _run(str(tiny_models["qwen2"][0]), "int8", kv_cache="contiguous")
    assert contiguous == greedy_runs["qwen2", "int8", "auto"][0]


def test_kernel_faked_absent_falls_back_with_the_same_tokens(greedy_runs, tiny_models, monkeypatch):
    monkeypatch.setattr(decode_kernel, "available", lambda kv_cache_dtype="auto": False)
    assert resolve_attention_backend("auto", "cpu", torch.float32, 4, 2, 16, "int8") == "bucketed"
    tokens, _, _, runner = _run(str(tiny_models["qwen2"][0]), "int8")
    assert runner.attention_backend == "bucketed"
    assert tokens == greedy_runs["qwen2", "int8", "auto"][0]


SMOL_PROMPTS = ["The history of the printing press begins in",
                "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                "Paris is the capital of France. Berlin is the capital of",
                "Once upon a time, in a small village by the sea, there lived"]


def test_real_smollm2_teacher_forced_top1_agreement():
    """Measured (fp32 weights, 4 prompts x 64 greedy tokens, CPU): int8 KV (Hadamard-rotated rows)
    agrees with ``auto`` KV on 256 of 256 teacher-forced top-1 choices, max logit error 0.69
    against a logit std of 8.7 (before the rotation: 249 / 256, 1.27: K's outlier channels
    doubled its int8 error). The target is >= 99%; a disagreement may only be a near-tie. One
    thread, as measured: at 2 threads (other GEMM reduction orders) 253 / 256 agree on this
    Intel Xeon, the three others near-ties (top-2 gaps 0.015-0.084), max error 0.45."""
    from atlas_vlm.default_models import default_text_model

    model, one_thread, threads = default_text_model(), dict(num_threads=1), torch.get_num_threads()
    try:
        auto_tokens, auto_logits, keys, _ = _run(model, "auto", n=64, prompts=SMOL_PROMPTS, **one_thread)
        _, q_logits, _, _ = _run(model, "int8", forced=dict(zip(keys, auto_tokens)), n=64, prompts=SMOL_PROMPTS,
                                 **one_thread)
    finally:
        torch.set_num_threads(threads)  # the process's threads for the tests after this one
    pairs = [(a, q) for a_seq, q_seq in zip(auto_logits, q_logits) for a, q in zip(a_seq, q_seq)]
    disagree = [a for a, q in pairs if a.argmax() != q.argmax()]
    assert len(pairs) == 256 and len(disagree) <= 2  # >= 99.2% (measured 100%)
    for a in disagree:
        top2 = a.topk(2).values
        assert top2[0] - top2[1] < 0.25  # a near-tie, not a wrong answer
    assert max((a - q).abs().max().item() for a, q in pairs) < 1.0  # measured 0.69 (1.27 unrotated)


@pytest.mark.vlm
def test_an_image_prompt_on_an_8bit_cache(tiny_models):
    """Visual tokens' K/V go through the same 8-bit path: the kernel and the reference backend
    give the same greedy tokens, and prefix-cache hits on the image read the stored codes."""
    from helpers import IMAGES, SMALL, conv, record

    folder = str(tiny_models["qwen2_5_vl"][0])
    msgs = [conv(IMAGES / "chelsea.png", text="What is in the picture?")] * 2  # the second hits the cache
    runs = {}
    for backend in ("auto", "reference"):
        llm = LLM(folder, dtype="float32", kv_cache_dtype="int8", attention_backend=backend, num_kvcache_blocks=64,
                  max_model_len=512, **SMALL)
        with record(llm) as rec:
            outs = [llm.chat(m, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0] for m in msgs]
        first_chunk = rec.by_request[outs[1].request_id][0]
        assert first_chunk["start"] >= 16 and outs[0].token_ids == outs[1].token_ids  # a prefix-cache hit
        runs[backend] = outs[0].token_ids
    assert runs["auto"] == runs["reference"]
