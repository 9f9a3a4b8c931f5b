"""The compiled decode step (``EngineConfig.compile_decode``, ``worker/compiled_decode.py``)
against the eager path on a tiny random Qwen2 in fp32: greedy tokens equal, every sampled
step's logits within 1e-4, the KV cache the same (padding rows write nothing harmful), with
batches that pad into buckets 1, 4 and 8 and shrink as requests finish; paged and contiguous
caches, the C-kernel and the gather-SDPA attention inside the op. The capability is faked
both ways (inductor present / absent) and a compile failure falls back to eager, logged once.
No timings are asserted."""

from __future__ import annotations

import pytest
import torch

from helpers import record
from atlas_vlm import LLM, EngineConfig, SamplingParams
from atlas_vlm.kernels import decode_kernel
from atlas_vlm.worker import compiled_decode
from atlas_vlm.worker.compiled_decode import batch_bucket, resolve_compile_decode

pytestmark = pytest.mark.text


def _llm(tiny_models, compile_decode, kv_cache="paged", backend="auto", max_num_seqs=8):
    blocks = 64 if kv_cache == "paged" else max_num_seqs
    return LLM(str(tiny_models["qwen2"][0]), device="cpu", dtype="float32", kv_cache=kv_cache, max_model_len=128,
               num_kvcache_blocks=blocks, max_num_seqs=max_num_seqs, attention_backend=backend,
               enable_prefix_caching=False, compile_decode=compile_decode)


def _prompts(n):
    # different lengths and output lengths: prefills land in different steps (mixed steps run
    # eager) and the decode batch shrinks as requests finish (new buckets, padding rows)
    return [{"prompt_token_ids": [100 + 11 * i + j for j in range(3 + 5 * i)]} for i in range(n)], \
        [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(n)]


def _generate(llm, n):
    prompts, params = _prompts(n)
    with record(llm) as rec:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.token_ids for o in outs], rec


@pytest.mark.parametrize("num_seqs, kv_cache, backend", [
    (1, "paged", "auto"), (5, "paged", "auto"), (3, "contiguous", "auto"), (3, "paged", "bucketed")])
def test_compiled_decode_equals_eager(tiny_models, num_seqs, kv_cache, backend):
    eager, compiled = _llm(tiny_models, False, kv_cache, backend), _llm(tiny_models, True, kv_cache, backend)
    assert eager.engine.runner.compiled_decode is None
    cd = compiled.engine.runner.compiled_decode
    assert cd is not None and cd.use_kernel == (eager.engine.runner.attention_backend == "decode_kernel")
    ref_tokens, ref_rec = _generate(eager, num_seqs)
    tokens, rec = _generate(compiled, num_seqs)
    assert cd.failed is None, cd.failed
    assert tokens == ref_tokens
    assert cd.num_compiled_steps > 0
    expected_buckets = {batch_bucket(n, 8) for n in range(1, num_seqs + 1)} if num_seqs > 1 else {1}
    assert set(cd.compile_seconds) <= expected_buckets and set(cd.compile_seconds)
    for rid in ref_rec.by_request:
        ours, ref = rec.sampled_logits(rid), ref_rec.sampled_logits(rid)
        assert len(ours) == len(ref)
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    # the same blocks were used in the same order: the caches agree everywhere (padding rows
    # wrote row 0's own K/V to row 0's slot, nothing else)
    for name in ("k_cache", "v_cache"):
        torch.testing.assert_close(getattr(compiled.engine.runner.kv_cache, name),
                                   getattr(eager.engine.runner.kv_cache, name), atol=1e-5, rtol=0)


def test_padding_rows_copy_row_zero(tiny_models):
    assert [batch_bucket(n, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert batch_bucket(6, 6) == 6 and batch_bucket(200, 256) == 200
    llm = _llm(tiny_models, False)
    runner = llm.engine.runner
    cd = compiled_decode.CompiledDecode(runner.model, runner.kv_cache, runner.block_size, 128, 8, False, False)
    seen = []

    def observe(chunks, inp, logits, sampled):  # after the forward, before requests move on
        if len(chunks) == 3 and cd.applies(chunks) and not seen:
            buf = compiled_decode._Buffers(4, cd.max_blocks, False, "cpu")
            cd.fill(chunks, buf)
            reqs = [r for r, _ in chunks]
            seen.append((buf, reqs, [r.block_table.slot(r.num_computed_tokens) for r in reqs],
                         [r.token_ids[r.num_computed_tokens] for r in reqs], [r.num_tokens for r in reqs],
                         [list(r.block_table.block_ids) for r in reqs]))

    runner.observers.append(observe)
    _generate(llm, 3)
    (buf, reqs, slots, ids, lens, tables), = seen
    assert buf.input_ids.tolist() == ids + ids[:1]
    assert buf.context_lens.tolist() == lens + lens[:1]
    assert buf.slot_mapping.tolist() == slots + slots[:1]
    assert buf.write_rows.tolist() == [0, 1, 2, 0]
    assert buf.positions.tolist() == [n - 1 for n in lens] + [lens[0] - 1]
    assert buf.block_tables.shape == (4, 128 // 16)
    for row, t in enumerate(tables + tables[:1]):
        assert buf.block_tables[row].tolist() == t + [0] * (8 - len(t))


def test_capability_faked_off_runs_eager_with_equal_tokens(tiny_models, monkeypatch):
    monkeypatch.setattr(compiled_decode, "inductor_available", lambda: "faked: no C++ compiler")
    on, why = resolve_compile_decode(True, "cpu")
    assert not on and "faked: no C++ compiler" in why
    llm = _llm(tiny_models, True)
    assert llm.engine.runner.compiled_decode is None and "faked" in llm.engine.runner.compile_decode_reason
    assert _generate(llm, 3)[0] == _generate(_llm(tiny_models, False), 3)[0]


def test_capability_faked_on_and_auto(monkeypatch):
    monkeypatch.setattr(compiled_decode, "inductor_available", lambda: None)
    assert resolve_compile_decode(True, "cpu")[0] is True
    assert resolve_compile_decode(False, "cpu")[0] is False
    assert resolve_compile_decode("auto", "cpu")[0] is False  # measured not to pay on CPU
    assert resolve_compile_decode("auto", "cuda")[0] is True
    monkeypatch.setattr(compiled_decode, "inductor_available", lambda: "faked")
    assert resolve_compile_decode("auto", "cuda")[0] is False


def test_inductor_detection_answers_here():
    # this machine runs the suite with a C++ compiler (the decode kernel's tests need one too)
    why_not = compiled_decode.inductor_available()
    assert why_not is None or isinstance(why_not, str)
    assert decode_kernel.available() is (decode_kernel._library() is not None)


def test_compile_failure_falls_back_to_eager_logged_once(tiny_models, monkeypatch, caplog):
    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("faked inductor failure")
        return run

    monkeypatch.setattr(compiled_decode.torch, "compile", broken)
    llm = _llm(tiny_models, True)
    with caplog.at_level("WARNING", logger="atlas_vlm.worker.compiled_decode"):
        tokens, _ = _generate(llm, 3)
    cd = llm.engine.runner.compiled_decode
    assert cd.failed is not None and "faked inductor failure" in cd.failed and cd.num_compiled_steps == 0
    assert sum("compiled decode step failed" in r.message for r in caplog.records) == 1
    monkeypatch.undo()
    assert tokens == _generate(_llm(tiny_models, False), 3)[0]


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_config_refuses_other_values(bad):
    with pytest.raises(ValueError, match="compile_decode"):
        EngineConfig(model="x", compile_decode=bad)
