"""Stage 3: the paged KV cache against the contiguous reference, plus MAC-1..MAC-5 at engine
level (block size 16) on tiny random Qwen2, Llama and Qwen3 models."""

from __future__ import annotations

import pytest
import torch

from helpers import StepRecorder
from atlas_vlm import LLM, SamplingParams
from atlas_vlm.engine import RequestTooLongError

pytestmark = pytest.mark.text

FAMILIES = ("qwen2", "llama", "qwen3")
BS = 16
PAGED_BLOCKS = 64


def greedy_params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 150000, (n,), generator=g).tolist()


def run(llm: LLM, prompts, params):
    """(outputs, logits per output [steps, vocab], recorder)."""
    with StepRecorder(llm) as rec:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, [torch.stack(rec.logits[o.request_id]) if o.finish_reason != "error" else None for o in outs], rec


def assert_all_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.engine.requests and not llm.engine.scheduler.has_unfinished()


def ceil_blocks(n: int) -> int:
    return -(-n // BS)


@pytest.fixture(scope="module")
def paged(tiny_models):
    return {fam: LLM(str(tiny_models[fam][0]), kv_cache="paged", max_model_len=512, num_kvcache_blocks=PAGED_BLOCKS, dtype="float32")
            for fam in FAMILIES}


@pytest.fixture(scope="module")
def contiguous(tiny_models):
    return {fam: LLM(str(tiny_models[fam][0]), kv_cache="contiguous", max_model_len=512, num_kvcache_blocks=4, dtype="float32")
            for fam in FAMILIES}


# ---- MAC-1 --------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_mac1_prefill_paged_equals_contiguous(family, paged, contiguous):
    lengths = [1, 15, 16, 17, 31, 32, 33, 100]
    for length in lengths:
        ids = prompt(length, seed=100 + length)
        (p_out,), (p_logits,), _ = run(paged[family], [ids], greedy_params(1))
        (c_out,), (c_logits,), _ = run(contiguous[family], [ids], greedy_params(1))
        assert p_logits.shape == c_logits.shape == (1, 151936)
        torch.testing.assert_close(p_logits, c_logits, atol=1e-5, rtol=1e-5, msg=lambda m: f"length {length}: {m}")
        assert p_out.token_ids == c_out.token_ids == [int(c_logits[0].argmax())]
    assert_all_free(paged[family])
    assert_all_free(contiguous[family])


# ---- MAC-2 --------------------------------------------------------------------------------
@pytest.mark.parametrize(("family", "length"), [("qwen2", 1), ("qwen2", 47), ("llama", 17), ("qwen3", 33)])
def test_mac2_32_decode_steps_paged_equals_contiguous_and_hf(family, length, paged, contiguous, tiny_models):
    ids = prompt(length, seed=200 + length)
    (p_out,), (p_logits,), _ = run(paged[family], [ids], greedy_params(32))
    (c_out,), (c_logits,), _ = run(contiguous[family], [ids], greedy_params(32))
    assert p_logits.shape == (32, 151936)
    for step in range(32):
        torch.testing.assert_close(p_logits[step], c_logits[step], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"step {step}: {m}")
    assert p_out.token_ids == c_out.token_ids
    assert p_out.token_ids == p_logits.argmax(-1).tolist()
    hf = tiny_models[family][1]
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=32,
                          eos_token_id=None, pad_token_id=0)
    assert ref.shape == (1, length + 32)  # HF ran all 32 steps too
    assert p_out.token_ids == ref[0, length:].tolist()
    assert p_out.finish_reason == c_out.finish_reason == "length"


# ---- MAC-3 --------------------------------------------------------------------------------
def test_mac3_c10_blocks_after_prefill_and_first_decode(paged):
    """C10: prompts of exactly 16 and 32 tokens hold 1 / 2 blocks after prefill and 2 / 3 once
    the first generated token's slot is reserved."""
    llm = paged["qwen2"]
    a, b = prompt(16, seed=301), prompt(32, seed=302)
    outs, _, rec = run(llm, [a, b], greedy_params(3))
    for out, expect in zip(outs, [(1, 2), (2, 3)]):
        first, second = rec.chunks[out.request_id][:2]
        assert (len(first[2]), len(second[2])) == expect
        assert first[:2] == (0, len(out.prompt_token_ids))  # the whole prompt in one step
        assert second[:2] == (len(out.prompt_token_ids), 1)
        assert second[2][:len(first[2])] == first[2]  # the table only grows at its end
    assert_all_free(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_mac3_blocks_track_tokens_and_are_all_freed(family, paged):
    llm = paged[family]
    bm = llm.engine.block_manager
    lengths = [1, 15, 16, 17, 31, 32, 33, 100]
    prompts = [prompt(n, seed=400 + n) for n in lengths]
    assert bm.num_free_blocks == PAGED_BLOCKS
    outs, _, rec = run(llm, prompts, greedy_params(20))
    for out, n in zip(outs, lengths):
        chunks = rec.chunks[out.request_id]
        assert len(out.token_ids) == 20 and len(chunks) == 20
        assert chunks[0][0] == 0 and chunks[0][1] == n
        assert len(chunks[0][2]) == ceil_blocks(n)  # exactly ceil(L / 16) after prefill
        for computed, new, table in chunks:
            assert len(table) == ceil_blocks(computed + new)  # a block only when crossing a boundary
            assert table[:len(chunks[0][2])] == chunks[0][2]
    for step in rec.steps:  # no block is live in two tables within a step (distinct prompts: no sharing)
        held = [b for _, _, _, table in step for b in table]
        assert len(held) == len(set(held))
    assert_all_free(llm)


# ---- MAC-4 --------------------------------------------------------------------------------
def kv_snapshot(llm: LLM):
    cache = llm.engine.runner.kv_cache
    return cache.k_cache.clone(), cache.v_cache.clone()


@pytest.mark.parametrize("family", FAMILIES)
def test_mac4_never_fitting_requests_refused_before_allocation(family, paged):
    llm = paged[family]
    engine = llm.engine
    bm = engine.block_manager
    before = kv_snapshot(llm)
    cases = [
        (prompt(600, seed=501), greedy_params(4), "max_model_len"),  # C16 (text): prompt over max_model_len
        (prompt(512, seed=502), greedy_params(1), "max_model_len"),  # no room for one generated token
        (prompt(500, seed=503), greedy_params(13), "over max_model_len 512"),  # prompt + max_tokens
    ]
    for ids, params, cause in cases:
        with pytest.raises(RequestTooLongError, match=cause):
            engine.add_request(ids, params)
        assert bm.num_free_blocks == PAGED_BLOCKS
        assert not engine.requests and not engine.scheduler.has_unfinished()
    after = kv_snapshot(llm)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_mac4_over_kv_capacity_refused(tiny_models):
    llm = LLM(str(tiny_models["qwen2"][0]), kv_cache="paged", max_model_len=512, num_kvcache_blocks=4, dtype="float32")
    with pytest.raises(RequestTooLongError, match=r"can never fit the KV cache \(4 blocks, 64 tokens\)"):
        llm.engine.add_request(prompt(50, seed=504), greedy_params(15))  # 65 tokens > 64 slots
    assert_all_free(llm)
    out = llm.generate(prompt(50, seed=504), greedy_params(14), use_tqdm=False)[0]  # 64: fits exactly
    assert len(out.token_ids) == 14 and out.finish_reason == "length"
    assert_all_free(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_mac4_bad_prompt_in_a_list_gets_an_error_others_unchanged(family, paged):
    llm = paged[family]
    good = [prompt(9, seed=511), prompt(40, seed=512)]
    alone = [run(llm, [g], greedy_params(10)) for g in good]
    outs, logits, _ = run(llm, [good[0], prompt(700, seed=513), good[1]], greedy_params(10))
    bad = outs[1]
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert "700 tokens" in bad.error and "max_model_len is 512" in bad.error
    for k, i in ((0, 0), (1, 2)):
        (a_out,), (a_logits,), _ = alone[k]
        assert outs[i].token_ids == a_out.token_ids and outs[i].finish_reason == "length"
        torch.testing.assert_close(logits[i], a_logits, atol=1e-5, rtol=1e-5)
    assert_all_free(llm)


# ---- MAC-5 --------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_mac5_different_lengths_together_equal_alone(family, paged, contiguous):
    lengths = [3, 16, 29, 50]
    max_tokens = [12, 5, 20, 8]
    prompts = [prompt(n, seed=600 + n) for n in lengths]
    params = [greedy_params(m) for m in max_tokens]
    outs, logits, _ = run(paged[family], prompts, params)
    for p, sp, out, lg in zip(prompts, params, outs, logits):
        (a_out,), (a_logits,), _ = run(contiguous[family], [p], sp)
        assert out.token_ids == a_out.token_ids
        assert lg.shape == a_logits.shape == (sp.max_tokens, 151936)
        torch.testing.assert_close(lg, a_logits, atol=1e-5, rtol=1e-5)
    assert_all_free(paged[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_mac5_freed_blocks_reused_change_nothing_for_others(family, tiny_models, contiguous):
    """8 blocks exactly: A (40 + 8 tokens, 3 blocks), B (20 + 2, 2 blocks), C (33 + 10, 3
    blocks). B finishes after two steps; D (25 + 6, 2 blocks) is added and must take B's
    freed blocks. A, C and D give the same tokens and logits as each alone; a refused
    request in the middle leaves every K/V byte in place."""
    llm = LLM(str(tiny_models[family][0]), kv_cache="paged", max_model_len=512, num_kvcache_blocks=8, dtype="float32")
    engine, bm = llm.engine, llm.engine.block_manager
    specs = {"A": (prompt(40, 701), 8), "B": (prompt(20, 702), 2), "C": (prompt(33, 703), 10), "D": (prompt(25, 704), 6)}
    alone = {k: run(contiguous[family], [p], greedy_params(m)) for k, (p, m) in specs.items()}
    outputs = {}
    with StepRecorder(llm) as rec:
        for k in "ABC":
            engine.add_request(specs[k][0], greedy_params(specs[k][1]), request_id=k)
        for _ in range(2):
            outputs.update({o.request_id: o for o in engine.step()})
        assert outputs["B"].finish_reason == "length" and len(outputs["B"].token_ids) == 2
        b_blocks = set(rec.chunks["B"][-1][2])
        assert len(b_blocks) == 2 and bm.num_free_blocks == 2
        # a request that can never fit is refused without touching anything
        snap, free = kv_snapshot(llm), bm.num_free_blocks
        with pytest.raises(RequestTooLongError):
            engine.add_request(prompt(120, 705), greedy_params(10), request_id="E")  # 130 > 128 slots
        assert bm.num_free_blocks == free and "E" not in engine.requests
        now = kv_snapshot(llm)
        assert torch.equal(snap[0], now[0]) and torch.equal(snap[1], now[1])
        engine.add_request(specs["D"][0], greedy_params(specs["D"][1]), request_id="D")
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step()})
    assert set(rec.chunks["D"][0][2]) == b_blocks  # D lives in B's old blocks
    assert engine.scheduler.num_preemptions == 0
    for k in "ACD":
        (a_out,), (a_logits,), _ = alone[k]
        assert outputs[k].token_ids == a_out.token_ids, k
        torch.testing.assert_close(torch.stack(rec.logits[k]), a_logits, atol=1e-5, rtol=1e-5, msg=lambda m: f"{k}: {m}")
    (b_alone,), _, _ = alone["B"]
    assert outputs["B"].token_ids == b_alone.token_ids
    assert_all_free(llm)


# ---- chunked prefill, preemption, prefix sharing: still the contiguous reference --------
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_preemption_equal_alone(family, tiny_models, contiguous):
    """A 24-token step budget splits prompts across steps next to running decodes, and 6
    blocks force a preemption (recompute); every request still matches running alone."""
    llm = LLM(str(tiny_models[family][0]), kv_cache="paged", max_model_len=512, num_kvcache_blocks=6,
              max_num_batched_tokens=24, dtype="float32")
    prompts = [prompt(10, 801), prompt(70, 802), prompt(30, 803)]
    params = [greedy_params(12), greedy_params(6), greedy_params(30)]
    outs, logits, rec = run(llm, prompts, params)
    assert max(n for chunks in rec.chunks.values() for _, n, _ in chunks) <= 24
    assert rec.chunks[outs[1].request_id][0][:2] == (0, 14)  # the 70-token prompt starts in step 1's leftover budget
    assert llm.engine.scheduler.num_preemptions >= 1
    for p, sp, out, lg in zip(prompts, params, outs, logits):
        (a_out,), (a_logits,), _ = run(contiguous[family], [p], sp)
        assert out.token_ids == a_out.token_ids
        torch.testing.assert_close(lg, a_logits, atol=1e-5, rtol=1e-5)
    assert_all_free(llm)


def test_prefix_shared_blocks_are_ref_counted_and_exact(paged, contiguous):
    llm = paged["qwen2"]
    engine, bm = llm.engine, llm.engine.block_manager
    shared = prompt(40, 901)
    a, b = shared + prompt(5, 902), shared + prompt(9, 903)
    (a_ref,), (a_ref_logits,), _ = run(contiguous["qwen2"], [a], greedy_params(6))
    (b_ref,), (b_ref_logits,), _ = run(contiguous["qwen2"], [b], greedy_params(6))
    run(llm, [a], greedy_params(6))  # fills the prefix cache with a's two full prompt blocks
    with StepRecorder(llm) as rec:
        engine.add_request(a, greedy_params(6), request_id="a2")
        engine.add_request(b, greedy_params(6), request_id="b")
        outs = {o.request_id: o for o in engine.step()}
        ta, tb = engine.requests["a2"].block_table.block_ids, engine.requests["b"].block_table.block_ids
        assert ta[:2] == tb[:2]  # both reuse the cached 32-token prefix
        assert [bm.blocks[i].ref_count for i in ta[:2]] == [2, 2]
        assert not set(ta[2:]) & set(tb[2:])
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step()})
    assert rec.chunks["a2"][0][:2] == (32, 13) and rec.chunks["b"][0][:2] == (32, 17)
    assert outs["a2"].token_ids == a_ref.token_ids and outs["b"].token_ids == b_ref.token_ids
    torch.testing.assert_close(torch.stack(rec.logits["a2"]), a_ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(rec.logits["b"]), b_ref_logits, atol=1e-5, rtol=1e-5)
    assert_all_free(llm)
