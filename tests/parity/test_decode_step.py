"""The one-call decode step (``atlas_vlm.kernels.decode_step``) against the op-by-op path it
replaces: the same requests with the step on and off give the same bits (every step's
logits, the tokens) for int8 / int4 tiny Llama, Qwen2, Qwen3 (q/k norms) in fp32 and bf16
and for the real SmolLM2 GGUF; it runs only for decode-only steps (speculative verification
rows included: a drafted step's k + 1 rows per request, with the op-by-op bits), and where it
cannot serve (a dense model, no quantized kernel) the engine says why and runs op by op."""

from __future__ import annotations

import pytest
import torch

from helpers import greedy, require_quant_kernel
from atlas_vlm import LLM, SamplingParams
from atlas_vlm.default_models import default_text_model
from atlas_vlm.kernels import decode_step as decode_step_module
from atlas_vlm.layers import quant_linear

pytestmark = pytest.mark.text
PROMPTS = [list(range(100, 140)), list(range(300, 311)), list(range(500, 517))]


# repetitive prompts: n-gram drafts found, accepted and rejected, different counts per request
SPEC_PROMPTS = [list(range(100, 108)) * 4, [300, 301, 302] * 5 + [7], list(range(500, 517))]
SPEC = dict(speculative="ngram", num_speculative_tokens=3, speculative_disable_by_batch_size=None)


def _run(llm: LLM, on: bool, prompts=PROMPTS, params=None, chunk_sizes=None):
    runner = llm.engine.runner
    calls = []
    if chunk_sizes is not None:  # each step's new tokens per request
        runner.observers.append(lambda chunks, inp, lg, sampled: chunk_sizes.append([n for _, n in chunks]))
    if not on:
        runner.decode_step = None
    else:
        step = runner.decode_step
        runner.decode_step = type("Counting", (), {"applies": step.applies,
                                                   "__call__": lambda self, *a: (calls.append(a[0].shape[0]),
                                                                                 step(*a))[1]})()
    logits = []
    runner.observers.append(lambda chunks, inp, lg, sampled: logits.append(lg.clone()))
    outs = llm.generate(prompts, params or greedy(10), use_tqdm=False)
    return [o.token_ids for o in outs], logits, calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_same_bits_as_op_by_op(family, method, dtype, tiny_models):
    require_quant_kernel("the decode step (it runs quantized kernels only)")
    folder, _ = tiny_models[family]

    def make():
        return LLM(str(folder), quantization=method, dtype=dtype, max_model_len=128, num_kvcache_blocks=32)

    fast = make()
    assert fast.engine.runner.decode_step is not None, fast.engine.runner.decode_step_reason
    tokens_on, logits_on, calls = _run(fast, True)
    tokens_off, logits_off, _ = _run(make(), False)
    assert tokens_on == tokens_off
    assert len(logits_on) == len(logits_off) and all(torch.equal(a, b) for a, b in zip(logits_on, logits_off))
    # decode-only steps ran in one call: 9 steps of 3 rows after the prefill step (10 tokens each)
    assert calls == [3] * 9
    # the runner's executors: the prefill step eager, the 9 decode steps through the C step
    assert dict(fast.engine.runner.executor_steps) == {"eager": 1, "decode_step": 9}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_drafted_steps_same_bits_as_op_by_op(method, dtype, tiny_models):
    """Speculation on: steps whose requests carry different numbers of drafts run in the one
    call (only the prefill runs op by op) with the op-by-op path's bits, and the tokens are
    those of decoding without drafts."""
    require_quant_kernel("the decode step (it runs quantized kernels only)")
    folder, _ = tiny_models["qwen3"]

    def make(**kw):
        return LLM(str(folder), quantization=method, dtype=dtype, max_model_len=128, num_kvcache_blocks=48, **kw)

    fast, sizes = make(**SPEC), []
    tokens_on, logits_on, calls = _run(fast, True, SPEC_PROMPTS, greedy(16), sizes)
    tokens_off, logits_off, _ = _run(make(**SPEC), False, SPEC_PROMPTS, greedy(16))
    assert tokens_on == tokens_off
    assert len(logits_on) == len(logits_off) and all(torch.equal(a, b) for a, b in zip(logits_on, logits_off))
    assert dict(fast.engine.runner.executor_steps) == {"eager": 1, "decode_step": len(calls)}
    # drafted steps were among them, with requests verifying different numbers of rows at once
    assert any(len(set(s)) > 1 and max(s) > 1 for s in sizes[1:]), sizes
    assert sum(calls) > sum(len(s) for s in sizes[1:])
    tokens_plain, _, _ = _run(make(), True, SPEC_PROMPTS, greedy(16))
    assert tokens_on == tokens_plain


def test_real_smollm2_gguf_same_bits():
    require_quant_kernel("the decode step on the real GGUF")

    def make():
        return LLM(default_text_model(), quantization="gguf_int", dtype="bfloat16", max_model_len=256,
                   num_kvcache_blocks=32)

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646], [1, 504, 3575, 282]]
    tokens_on, logits_on, calls = _run(make(), True, prompts, params)
    tokens_off, logits_off, _ = _run(make(), False, prompts, params)
    assert calls and tokens_on == tokens_off
    assert all(torch.equal(a, b) for a, b in zip(logits_on, logits_off))


def test_real_smollm2_gguf_drafted_steps_same_bits():
    """The Q4_1 GGUF as stored, bf16, speculation on: drafted steps in the one call with the
    op-by-op bits, the tokens of decoding without drafts."""
    require_quant_kernel("the decode step on the real GGUF")

    def make(**kw):
        return LLM(default_text_model(), quantization="gguf_int", dtype="bfloat16", max_model_len=256,
                   num_kvcache_blocks=32, **kw)

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = ["Repeat this list exactly: apples, pears, plums, figs, dates, limes, apples, pears, plums.",
               "Copy: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16"]
    fast = make(**SPEC)
    tokens_on, logits_on, calls = _run(fast, True, prompts, params)
    tokens_off, logits_off, _ = _run(make(**SPEC), False, prompts, params)
    assert tokens_on == tokens_off
    assert len(logits_on) == len(logits_off) and all(torch.equal(a, b) for a, b in zip(logits_on, logits_off))
    assert fast.engine.runner.executor_steps["eager"] == 1 and sum(calls) > len(calls) * len(prompts)  # drafts in C
    assert tokens_on == _run(make(), True, prompts, params)[0]


def test_a_one_token_prompt_chunk_beside_a_decode_gets_no_logits_row():
    """A step of one decode row and one mid-prompt token (chunked prefill, a budget of 2) is
    decode rows only, so it runs in the one call; the quantized LM head's logits of the
    unsampled prompt row are dropped (one row per sampled token), tokens as op by op."""
    require_quant_kernel("the decode step on the real GGUF")
    outs = []
    for on in (True, False):
        llm = LLM(default_text_model(), quantization="gguf_int", dtype="bfloat16", max_model_len=256,
                  num_kvcache_blocks=32, max_num_batched_tokens=2)
        runner, eng, rows = llm.engine.runner, llm.engine, []
        if not on:
            runner.decode_step = None
        runner.observers.append(lambda chunks, inp, lg, sampled: rows.append((len(chunks), lg.shape[0], len(sampled))))
        a = eng.add_request([1, 9690], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        for _ in range(3):
            eng.step()
        b = eng.add_request([1, 504, 3575, 282, 33, 44], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        done = {}
        while eng.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        assert all(n == s for _, n, s in rows) and (2, 1, 1) in rows  # a step of 2 chunks, 1 sampled
        outs.append((done[a], done[b], runner.executor_steps["decode_step"]))
    assert outs[0][:2] == outs[1][:2] and outs[0][2] > 0 and outs[1][2] == 0


def test_where_it_does_not_serve_the_engine_says_why(tiny_models, monkeypatch):
    folder, _ = tiny_models["qwen2"]
    dense = LLM(str(folder), dtype="float32", max_model_len=64, num_kvcache_blocks=8)
    assert dense.engine.runner.decode_step is None
    assert "quantized" in dense.engine.runner.decode_step_reason
    monkeypatch.setattr(quant_linear, "quant_kernel_available", lambda *a, **k: False)
    ref = LLM(str(folder), quantization="int4", dtype="float32", max_model_len=64, num_kvcache_blocks=8)
    assert ref.engine.runner.decode_step is None and "kernel path" in ref.engine.runner.decode_step_reason
    monkeypatch.undo()
    monkeypatch.setattr(decode_step_module, "_library", lambda: None)
    no_lib = LLM(str(folder), quantization="int4", dtype="float32", max_model_len=64, num_kvcache_blocks=8)
    assert no_lib.engine.runner.decode_step is None and "build" in no_lib.engine.runner.decode_step_reason
    assert no_lib.generate([PROMPTS[1]], greedy(4), use_tqdm=False)[0].finish_reason == "length"  # op by op


def test_a_slot_outside_the_cache_is_refused_before_any_write(tiny_models):
    require_quant_kernel("the decode step")
    folder, _ = tiny_models["qwen2"]
    llm = LLM(str(folder), quantization="int8", dtype="float32", max_model_len=64, num_kvcache_blocks=8)
    runner = llm.engine.runner
    seen = {}

    def grab(chunks, inp, lg, sampled):
        if runner.decode_step.applies(inp.meta, inp.input_ids.shape[0], False):
            seen.setdefault("meta", inp.meta)

    runner.observers.append(grab)
    llm.generate([PROMPTS[1]], greedy(3), use_tqdm=False)
    meta = seen["meta"]
    meta.slot_mapping = torch.tensor([8 * 16])  # one past the last slot of 8 blocks of 16
    before = runner.kv_cache.k_cache.clone(), runner.kv_cache.v_cache.clone()
    x = torch.zeros(1, runner.model.arch.hidden_size)
    cos, sin = runner.model.model.rotary(torch.tensor([5]), torch.float32)
    with pytest.raises(RuntimeError, match="refused"):
        runner.decode_step(x, cos, sin, meta)
    assert torch.equal(runner.kv_cache.k_cache, before[0]) and torch.equal(runner.kv_cache.v_cache, before[1])


def test_a_step_that_samples_no_row_runs_on_the_quantized_lm_head():
    """With a budget of 2 tokens, the first steps of a 6-token prompt are mid-prompt chunks
    alone: no row is sampled, so the quantized LM head gets 0 rows (it raised before). The
    tokens equal those of an unchunked prefill."""
    require_quant_kernel("the quantized LM head on the real GGUF")
    prompt, params = [1, 504, 3575, 282, 33, 44], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = [LLM(default_text_model(), quantization="gguf_int", dtype="float32", max_model_len=256, num_kvcache_blocks=32,
                max_num_batched_tokens=budget).generate([prompt], params, use_tqdm=False)[0].token_ids
            for budget in (2, 256)]
    assert outs[0] == outs[1] and len(outs[0]) == 6


def _gguf_model(folder, dtype: str):
    """An LLM on ``folder`` whose projections and LM head are swapped for ``GGUFLinear`` on
    random Q4_K (q/k/v, gate/up) and Q6_K (o, down, head) blocks (the same for every call; layer
    0's q/k/v a ``GGUFFusedLinear`` of Q4_K q / k and a Q6_K v, as a Q4_K_M file), its one-call
    step rebuilt: what a GGUF-as-stored model gives the runner."""
    from test_gguf_kernel import _blocks

    from atlas_vlm.layers.gguf_linear import GGUFLinear
    from atlas_vlm.layers.gguf_stored import GGUFFusedLinear
    from atlas_vlm.worker.decode_step import DecodeStep

    llm = LLM(str(folder), dtype=dtype, max_model_len=128, num_kvcache_blocks=32)
    runner, seed = llm.engine.runner, 0

    def swap(parent, name, qtype):
        nonlocal seed
        old = getattr(parent, name)
        n, k = old.out_features, old.in_features
        seed += 1
        blocks = _blocks(qtype, n, k, seed=seed)
        bias = None if old.bias is None else old.bias.detach().float()
        setattr(parent, name, GGUFLinear(blocks, qtype, k, n, bias))

    def swap_mixed_qkv(attn):  # Q4_K_M's layout: Q4_K q / k beside a Q6_K v, a GGUFFusedLinear
        nonlocal seed
        old, arch = attn.qkv_proj, runner.model.arch
        sizes = [arch.num_heads * arch.head_dim] + [arch.num_kv_heads * arch.head_dim] * 2
        biases = [None] * 3 if old.bias is None else list(old.bias.detach().float().split(sizes))
        parts = []
        for n, qtype, bias in zip(sizes, ["Q4_K", "Q4_K", "Q6_K"], biases):
            seed += 1
            parts.append(GGUFLinear(_blocks(qtype, n, old.in_features, seed=seed), qtype, old.in_features, n, bias))
        attn.qkv_proj = GGUFFusedLinear(parts)

    for i, layer in enumerate(runner.model.model.layers):
        for parent, name, qtype in [(layer.self_attn, "qkv_proj", "Q4_K"), (layer.self_attn, "o_proj", "Q6_K"),
                                    (layer.mlp, "gate_up_proj", "Q4_K"), (layer.mlp, "down_proj", "Q6_K")]:
            if (i, name) == (0, "qkv_proj"):
                swap_mixed_qkv(layer.self_attn)
            else:
                swap(parent, name, qtype)
    swap(runner.model, "lm_head", "Q6_K")
    step, why = DecodeStep.build(runner.model, runner.kv_cache, runner.attention_backend)
    assert step is not None, why
    runner.decode_step = step
    return llm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_as_stored_same_bits_as_op_by_op(dtype, tmp_path, tiny_models):
    """GGUFLinear projections (interleaved Q4_K / Q6_K, Qwen2's q/k/v bias) and LM head in the
    one call: the op-by-op path's logits bit for bit, and its tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from atlas_vlm.kernels import gguf_kernel
    from transformers import AutoTokenizer

    if not gguf_kernel.available():
        pytest.skip("no C compiler: GGUFLinear runs its reference, the step does not serve")
    config = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_models["qwen2"][0]).save_pretrained(tmp_path)  # the Qwen tokenizer
    prompts = [list(range(100, 140)), list(range(300, 311)), list(range(500, 517))]
    tokens_on, logits_on, calls = _run(_gguf_model(tmp_path, dtype), True, prompts)
    tokens_off, logits_off, _ = _run(_gguf_model(tmp_path, dtype), False, prompts)
    assert calls == [3] * 9 and tokens_on == tokens_off
    assert len(logits_on) == len(logits_off) and all(torch.equal(a, b) for a, b in zip(logits_on, logits_off))
    assert not any(lg.isnan().any() for lg in logits_on)
