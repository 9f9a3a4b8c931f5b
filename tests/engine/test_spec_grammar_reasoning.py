"""Speculative drafts for grammar requests while their reasoning runs (issue 26): drafts are
free up to the reasoning's end marker, the grammar checks the ones after it; greedy outputs
equal decoding without drafts token for token (fp32), with drafts accepted inside the
reasoning and drafts crossing ``</think>``; the JSON after the reasoning is valid; and, on
the manager, the verified rows' masks split at the drafted end marker.

A random model never writes ``</think>``: the test model's ``</think>`` embedding (tied to
its output row) is a token its greedy loop writes, times 1.01, so it writes ``</think>``
where it wrote that token."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.reasoning import ENDED, MAYBE, REASONING
from atlas_vlm.structured_output import StructuredOutputsParams
from atlas_vlm.structured_output.backend import allocate_token_bitmask
from helpers import compiled_json_request
from atlas_vlm.structured_output.drafts import row_plan
from conftest import build_tiny_model

pytestmark = pytest.mark.text

START, END = 151667, 151668  # <think>, </think> in the Qwen tokenizer
LOOPED = 102262  # a token the seed-0 tiny Qwen3 writes after 粉粉粉粉 (prompt ONE_TWO + <think>)
FEN = 99742  # 粉
SCHEMA = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 6, "maxItems": 6}
KW = dict(dtype="float32", max_model_len=512, kvcache_block_size=4, num_kvcache_blocks=512, device="cpu",
          reasoning_parser="qwen3")
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("thinker")
    model = build_tiny_model("qwen3", out, seed=0)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight  # tied: also the output row of </think>
        emb[END] = emb[LOOPED] * 1.01
    model.save_pretrained(out)
    return out


def prompts(tok):
    """Prompts ending inside the reasoning (``<think>`` last): one reasons 粉粉粉粉 (drafts
    accepted) then answers; one has 粉</think> in its prompt (n-gram drafts cross the end
    marker); one reasons until ``max_tokens`` (free text, drafts accepted in its loops)."""
    one_two = tok.encode("one two three one two three one two", add_special_tokens=False)
    return [one_two + [START], one_two + [FEN] * 4 + [END, START],
            tok.encode("a b a b a b", add_special_tokens=False) + [START]]


def params(**kw):
    return [SamplingParams(max_tokens=80, logprobs=2, structured_outputs={"json": SCHEMA}, **kw) for _ in range(3)]


def run_steps(llm, token_prompts, sps):
    """Step the engine; returns (final outputs by prompt, steps that took >= 2 reasoning
    tokens (a draft accepted inside the reasoning), steps that took tokens past a drafted
    end marker)."""
    eng = llm.engine
    mgr = eng.structured_output_manager
    ids = [eng.add_request({"prompt_token_ids": p}, sp) for p, sp in zip(token_prompts, sps)]
    seen, finals, inside, crossed = dict.fromkeys(ids, 0), {}, 0, 0
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        before = {rid: mgr._requests[rid].reasoning for rid in ids if mgr.has(rid)}
        for out in eng.step():
            new = out.token_ids[seen[out.request_id]:]
            seen[out.request_id] = len(out.token_ids)
            if before.get(out.request_id) == REASONING:
                thought = new[:new.index(END) + 1] if END in new else new
                inside += len(thought) >= 2
                crossed += END in new and new.index(END) < len(new) - 1
            if out.finished:
                finals[out.request_id] = out
    return [finals[rid] for rid in ids], inside, crossed


def answer(out):
    assert out.finish_reason == "stop" and END in out.token_ids, (out.token_ids, out.text, out.error)
    return out.text.split("</think>", 1)[1]


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_reasoning_then_json_equals_decoding_without_drafts(folder, k):
    ref_llm = LLM(str(folder), **KW)
    tp = prompts(ref_llm.tokenizer)
    refs = ref_llm.generate([{"prompt_token_ids": p} for p in tp], params(temperature=0), use_tqdm=False)
    llm = LLM(str(folder), speculative="ngram", num_speculative_tokens=k, speculative_disable_by_batch_size=None, **KW)
    outs, inside, crossed = run_steps(llm, tp, params(temperature=0))
    for o, r in zip(outs, refs):
        assert o.token_ids == r.token_ids and o.text == r.text and o.finish_reason == r.finish_reason
        assert o.logprobs == pytest.approx(r.logprobs, abs=LOGPROB_ATOL)
    for o in outs[:2]:  # reasoned, closed it, answered valid JSON
        jsonschema.validate(json.loads(answer(o)), SCHEMA)
    assert outs[2].finish_reason == "length" and END not in outs[2].token_ids
    stats = llm.engine.structured_output_manager.stats
    assert inside > 0 and stats.reasoning_drafts > 0  # drafts proposed and accepted while thinking
    assert stats.end_crossings > 0  # drafts crossed </think>: the grammar checked those after it
    assert crossed > 0  # and a step took </think> and the answer's first tokens from drafts
    assert llm.engine.scheduler.spec_decode_stats["accepted"] > 0
    assert not llm.engine.structured_output_manager._requests


def test_sampled_with_seed_reproducible_and_valid(folder):
    """Seeded sampling (rejection sampling over the split rows): the same seeds give the same
    tokens run after run, drafts are proposed while thinking, every answer is valid. (Sampled
    tokens are not those of decoding without drafts: the verifier draws its random numbers
    differently; its distribution is tested in test_spec_rejection. The tiny model's
    distribution is flat, so its sampled text rarely repeats: few drafts, none accepted.)"""
    runs = []
    for _ in range(2):
        llm = LLM(str(folder), speculative="ngram", num_speculative_tokens=3, speculative_disable_by_batch_size=None,
                  **KW)
        tp = prompts(llm.tokenizer)
        sps = [SamplingParams(temperature=0.05, seed=s, max_tokens=80, structured_outputs={"json": SCHEMA})
               for s in range(3)]
        outs, _, _ = run_steps(llm, tp, sps)
        runs.append([o.token_ids for o in outs])
        assert llm.engine.structured_output_manager.stats.reasoning_drafts > 0
        for o in outs:
            if o.finish_reason == "stop":
                jsonschema.validate(json.loads(answer(o)), SCHEMA)
            else:
                assert o.finish_reason == "length", (o.text, o.error)
    assert runs[0] == runs[1]


# ---- the manager alone ----------------------------------------------------------------------

def _row(grammar, words):
    mask = allocate_token_bitmask(1, words * 32)
    grammar.fill_bitmask(mask, 0)
    return mask[0]


def _ready_manager(folder, prompt_tail):
    from transformers import AutoTokenizer

    from atlas_vlm.reasoning import get_reasoning_parser
    from atlas_vlm.structured_output.manager import StructuredOutputManager

    tok = AutoTokenizer.from_pretrained(str(folder))
    mgr = StructuredOutputManager(tok, len(tok), {tok.eos_token_id}, get_reasoning_parser("qwen3", tok))
    req = compiled_json_request(mgr, SCHEMA, [1, 2] + prompt_tail)
    return tok, mgr, req


def _step_masks(mgr, req, drafts):
    req.spec_token_ids = list(drafts)
    req.token_ids = req.token_ids + list(drafts)
    req.num_tokens, req.num_computed_tokens = len(req.token_ids), len(req.token_ids) - len(drafts) - 1
    return mgr.grammar_bitmask([(req, len(drafts) + 1)])


def test_row_plan_splits_at_the_end_marker():
    assert row_plan(ENDED, [5, 6], START, END) == [(0, [5, 6])]
    assert row_plan(REASONING, [5, 6], START, END) == []  # every row free
    assert row_plan(REASONING, [5, END, 7, 8], START, END) == [(2, [7, 8])]
    assert row_plan(REASONING, [5, END], START, END) == [(2, [])]
    assert row_plan(MAYBE, [5, 6], START, END) == [(0, [5, 6])]
    assert row_plan(MAYBE, [START, 5, END, 7], START, END) == [(0, []), (3, [7])]
    assert row_plan(MAYBE, [START, 5], START, END) == [(0, [])]
    with pytest.raises(ValueError, match="reasoning state"):
        row_plan("thinking", [5], START, END)


def test_masks_split_at_a_drafted_end_marker(folder):
    """REASONING: rows up to the drafted </think> are free (all bits set), the rows after it
    are the grammar's masks from its start after the drafts past the marker; drafts the
    grammar refuses after the marker are cut; the matcher is untouched afterwards and then
    fed exactly the tokens taken."""
    tok, mgr, req = _ready_manager(folder, [START])
    answer_ids = tok.encode('["red", "green"', add_special_tokens=False)
    words_text = tok.encode(" hmm ok", add_special_tokens=False)
    bad = tok.encode("!", add_special_tokens=False)[0]
    drafts = words_text + [END] + answer_ids[:2]
    assert mgr.draft_prefix(req, drafts + [bad, answer_ids[2]]) == len(drafts)  # cut at the refused one
    assert mgr.draft_prefix(req, words_text * 3) == 3 * len(words_text)  # free while thinking
    assert mgr.stats.end_crossings == 1 and mgr.stats.reasoning_drafts == len(words_text) + 1 + 3 * len(words_text)
    e = len(words_text)
    masks = _step_masks(mgr, req, drafts).bitmask
    assert masks.shape[0] == len(drafts) + 1
    assert bool((masks[:e + 1] == -1).all())  # rows before and at the end marker: no constraint
    fresh = mgr.backend.compile_grammar(StructuredOutputsParams(json=SCHEMA))
    words = masks.shape[1]
    for j, row in enumerate(range(e + 1, len(drafts) + 1)):  # the grammar's rows, drafts accepted
        assert torch.equal(masks[row], _row(fresh, words)), row
        if row < len(drafts):
            assert fresh.accept_token(drafts[row])
    assert not torch.equal(masks[e + 1], masks[e])
    live = mgr._requests["r"].grammar
    start_mask = _row(mgr.backend.compile_grammar(StructuredOutputsParams(json=SCHEMA)), words)
    assert torch.equal(_row(live, words), start_mask) and mgr._requests["r"].reasoning == REASONING
    # a plain step inside the reasoning (no end marker drafted) needs no mask at all
    req.token_ids = req.token_ids[:-len(drafts)]
    assert _step_masks(mgr, req, words_text) is None
    req.token_ids = req.token_ids[:-len(words_text)]
    # the sampler took two thinking tokens, </think> and '[': the state moves as without drafts
    for t in words_text + [END]:
        assert mgr.accept_token(req, t) == (False, None)
    assert mgr._requests["r"].reasoning == ENDED and torch.equal(_row(live, words), start_mask)
    assert mgr.accept_token(req, answer_ids[0]) == (False, None)
    assert mgr.draft_prefix(req, [END]) == 0  # the grammar now checks every draft
    mgr.remove_request("r")


def test_maybe_row_zero_allows_the_start_marker_and_a_drafted_start_opens_the_reasoning(folder):
    """MAYBE (no marker in the prompt): row 0 is the grammar's mask plus <think>; drafts that
    open the reasoning are free up to </think>, the grammar checks the ones after it."""
    tok, mgr, req = _ready_manager(folder, [])
    assert mgr._requests["r"].reasoning == MAYBE
    lb = tok.encode("[", add_special_tokens=False)
    thought = tok.encode(" so", add_special_tokens=False)
    drafts = [START] + thought + [END] + lb
    assert mgr.draft_prefix(req, drafts) == len(drafts)
    assert mgr.draft_prefix(req, thought) == 0  # the grammar refuses free text as the answer
    masks = _step_masks(mgr, req, drafts).bitmask
    words = masks.shape[1]
    start = _row(mgr.backend.compile_grammar(StructuredOutputsParams(json=SCHEMA)), words)
    assert not bool(start[START // 32] >> (START % 32) & 1)  # the grammar alone refuses <think>
    assert bool(masks[0, START // 32] >> (START % 32) & 1)
    masks[0, START // 32] &= ~(1 << (START % 32))
    assert torch.equal(masks[0], start)  # row 0: the grammar's mask plus <think>
    e = 1 + len(thought)
    assert bool((masks[1:e + 1] == -1).all())  # inside the drafted reasoning: free
    assert torch.equal(masks[e + 1], start)  # right after </think>: the grammar from its start
    fresh = mgr.backend.compile_grammar(StructuredOutputsParams(json=SCHEMA))
    assert fresh.accept_token(lb[0])
    assert torch.equal(masks[e + 2], _row(fresh, words))
    mgr.remove_request("r")
