"""Structured output under speculative decoding (n-gram drafts, issue 26): greedy requests
with a JSON schema, a regex and a choice give exactly the tokens and logprobs of decoding
without drafts (fp32), with drafts both cut by the grammar and accepted; the outputs are
valid; grammar requests batch beside plain drafted ones; an abort mid-run drops the grammar
state and gives every block back; and, on the manager, the matcher after a drafted step is
exactly the matcher fed only the accepted tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.structured_output import StructuredOutputsParams
from atlas_vlm.structured_output.backend import allocate_token_bitmask
from helpers import compiled_json_request

pytestmark = pytest.mark.text

LOGPROB_ATOL = 1e-4
BASE = dict(max_model_len=512, kvcache_block_size=4, num_kvcache_blocks=512, device="cpu", dtype="float32")
SCHEMA = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 6, "maxItems": 6}
REGEX = "(ab|cd)( (ab|cd)){0,12}"
CHOICES = ["red green blue red green blue", "one two three"]
# prompts whose n-grams the output repeats (drafts accepted) and breaks (drafts the grammar cuts)
PROMPTS = ['["red", "green", "blue", "red", "green", "blue", "red", "green"', "ab cd ab cd xy ab cd ab zz ab cd",
           "red green blue red green blue one two"]
PLAIN_PROMPTS = ["a b c d a b c d a b c d a b c", "one two three four five six one two three four five six one"]


def constrained(max_tokens=60):
    return [SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=3, structured_outputs=s)
            for s in ({"json": SCHEMA}, {"regex": REGEX}, {"choice": CHOICES})]


def plain_params(max_tokens=24):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def folder(tiny_models):
    return tiny_models["qwen2"][0]


@pytest.fixture(scope="module")
def reference(folder):
    """Outputs without speculation: the constrained prompts, then the plain ones."""
    llm = LLM(str(folder), **BASE)
    return (llm.generate(PROMPTS, constrained(), use_tqdm=False),
            llm.generate(PLAIN_PROMPTS, plain_params(), use_tqdm=False))


def spec_llm(folder, k):
    return LLM(str(folder), speculative="ngram", num_speculative_tokens=k, speculative_disable_by_batch_size=None,
               **BASE)  # drafts in batches too: the tests batch requests


def assert_same(ref, out):
    assert out.token_ids == ref.token_ids
    assert out.text == ref.text
    assert (out.finish_reason, out.error) == (ref.finish_reason, ref.error)
    assert len(out.logprobs) == len(ref.logprobs) == len(ref.token_ids)
    for a, b, ta, tb in zip(out.logprobs, ref.logprobs, out.top_logprobs, ref.top_logprobs):
        assert a == pytest.approx(b, abs=LOGPROB_ATOL)
        assert ta.keys() == tb.keys()
        assert all(ta[t] == pytest.approx(tb[t], abs=LOGPROB_ATOL) for t in ta)


def assert_valid(outs):
    js, rx, ch = outs
    assert js.finish_reason == "stop" and rx.finish_reason == "stop" and ch.finish_reason == "stop"
    jsonschema.validate(json.loads(js.text), SCHEMA)
    assert re.fullmatch(REGEX, rx.text)
    assert ch.text in CHOICES


def assert_all_blocks_back(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_grammars_equal_decoding_without_drafts(folder, reference, k):
    llm = spec_llm(folder, k)
    outs = llm.generate(PROMPTS, constrained(), use_tqdm=False)
    for o, r in zip(outs, reference[0]):
        assert_same(r, o)
    assert_valid(outs)
    spec = llm.engine.scheduler.spec_decode_stats
    grammar = llm.engine.structured_output_manager.stats
    assert spec["accepted"] > 0 and spec["proposed"] > spec["accepted"]  # drafts accepted and rejected
    assert grammar.drafts_cut > 0 and grammar.drafts_checked > grammar.drafts_cut  # some cut, some kept
    assert spec["proposed"] == grammar.drafts_checked - grammar.drafts_cut  # only kept drafts were verified
    assert not llm.engine.structured_output_manager._requests
    assert_all_blocks_back(llm)


def test_grammar_requests_beside_plain_drafted_ones(folder, reference):
    llm = spec_llm(folder, 3)
    params = constrained() + [plain_params()] * len(PLAIN_PROMPTS)
    outs = llm.generate(PROMPTS + PLAIN_PROMPTS, params, use_tqdm=False)
    for o, r in zip(outs, reference[0] + reference[1]):
        assert_same(r, o)
    assert_valid(outs[:3])
    assert llm.engine.scheduler.spec_decode_stats["accepted"] > 0
    assert llm.engine.structured_output_manager.stats.drafts_cut > 0
    assert_all_blocks_back(llm)


def test_sampled_grammar_requests_with_drafts_stay_valid(folder):
    """Temperature 1 (rejection sampling over the masked rows): every output is valid."""
    llm = spec_llm(folder, 4)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_outputs={"json": SCHEMA})
              for s in range(4)]
    outs = llm.generate([PROMPTS[0]] * 4, params, use_tqdm=False)
    for o in outs:
        assert o.finish_reason == "stop", (o.text, o.error)
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert llm.engine.scheduler.spec_decode_stats["proposed"] > 0
    assert_all_blocks_back(llm)


def test_abort_mid_run_discards_the_grammar_and_gives_blocks_back(folder, reference):
    llm = spec_llm(folder, 4)
    eng = llm.engine
    ids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, constrained())]
    mgr = eng.structured_output_manager
    for _ in range(200):
        eng.step()
        if eng.scheduler.spec_decode_stats["accepted"] > 0:
            break
    assert eng.scheduler.spec_decode_stats["accepted"] > 0 and mgr.has(ids[0])
    aborted = eng.abort_request(ids[0])
    assert aborted.finish_reason == "abort" and not mgr.has(ids[0])
    finals = {}
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    for rid, r in zip(ids[1:], reference[0][1:]):
        assert_same(r, finals[rid])
    assert not mgr._requests
    assert_all_blocks_back(llm)


# ---- the manager alone ----------------------------------------------------------------------

def _row(grammar, words):
    mask = allocate_token_bitmask(1, words * 32)
    grammar.fill_bitmask(mask, 0)
    return mask[0]


def test_matcher_after_a_drafted_step_is_fed_only_the_accepted_tokens(folder):
    from atlas_vlm.structured_output.manager import StructuredOutputManager
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    mgr = StructuredOutputManager(tok, len(tok), {tok.eos_token_id})
    text = '["red", "green", "blue", "red", "green", "blue"]'
    ids = tok.encode(text, add_special_tokens=False)
    req = compiled_json_request(mgr, SCHEMA, [1, 2])
    fed = 2
    for t in ids[:fed]:
        assert mgr.accept_token(req, t) == (False, None)
    bad = tok.encode("!", add_special_tokens=False)[0]
    drafts = ids[fed:fed + 3] + [bad] + ids[fed + 3:fed + 5]
    assert mgr.draft_prefix(req, drafts) == 3  # cut at the refused token, nothing consumed
    assert mgr.stats.drafts_cut == 3
    req.spec_token_ids = drafts[:3]
    req.token_ids = [1, 2] + ids[:fed] + req.spec_token_ids
    req.num_tokens, req.num_computed_tokens = len(req.token_ids), len(req.token_ids) - 4
    gb = mgr.grammar_bitmask([(req, 4)])
    assert gb.request_ids == ["r"] * 4
    masks = gb.bitmask
    words = masks.shape[1]
    fresh = mgr.backend.compile_grammar(StructuredOutputsParams(json=SCHEMA))
    for t in ids[:fed]:
        assert fresh.accept_token(t)
    for j in range(4):  # row j: the mask after the first j drafts
        assert torch.equal(masks[j], _row(fresh, words))
        if j < 3:
            assert fresh.accept_token(drafts[j])
    live = mgr._requests["r"].grammar
    fresh.rollback(3)
    assert torch.equal(_row(live, words), _row(fresh, words))  # every draft rolled back
    # the sampler took two drafts and a token of its own: fed as plain decode feeds them
    for t in ids[fed:fed + 3]:
        assert mgr.accept_token(req, t) == (False, None)
        assert fresh.accept_token(t)
    assert torch.equal(_row(live, words), _row(fresh, words))
    for t in ids[fed + 3:]:
        terminated, error = mgr.accept_token(req, t)
        assert error is None
    assert terminated  # the array closed: the grammar ends there
    assert mgr.draft_prefix(req, [ids[0]]) == 0  # an ended grammar keeps no draft
    mgr.remove_request("r")
    assert not mgr.has("r")


def test_drafts_past_the_end_of_the_grammar_leave_it_intact(folder):
    """Drafts "yes" + EOS for the choice "yes": the grammar ends at "yes" (the library would
    not record the EOS after it); every row after that keeps the ended grammar's mask and
    the state afterwards is the state before."""
    from atlas_vlm.structured_output.manager import StructuredOutputManager
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    mgr = StructuredOutputManager(tok, len(tok), {tok.eos_token_id})
    params = StructuredOutputsParams(choice=["yes"])
    grammar = mgr.backend.compile_grammar(params)
    drafts = tok.encode("yes", add_special_tokens=False) + [tok.eos_token_id]
    words = allocate_token_bitmask(1, mgr.backend.mask_vocab_size).shape[1]
    before = _row(grammar, words)
    masks = allocate_token_bitmask(len(drafts) + 1, mgr.backend.mask_vocab_size)
    grammar.fill_draft_bitmasks(masks, 0, drafts)
    assert not grammar.is_terminated() and grammar.error() is None
    assert torch.equal(_row(grammar, words), before) and torch.equal(masks[0], before)
    ended = mgr.backend.compile_grammar(params)
    for t in drafts[:-1]:
        assert ended.accept_token(t)
    assert ended.is_terminated()
    for j in range(len(drafts) - 1, len(drafts) + 1):
        assert torch.equal(masks[j], _row(ended, words))
    assert not torch.equal(masks[-1], before)
