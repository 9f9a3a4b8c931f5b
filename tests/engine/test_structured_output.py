"""Structured output on tiny random models: random weights leave the grammar to do all the
work, so every constrained output must parse (JSON + ``jsonschema``), ``re.fullmatch`` or be
one of the choices, whatever the seed; unconstrained rows of the same batch are untouched;
EOS only where the grammar accepts; preemption resumes the matcher; ids past the tokenizer
(the logits are wider than the vocabulary) are never allowed in a constrained row."""

from __future__ import annotations

import json
import re

import jsonschema
import pydantic
import pytest
import torch

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.structured_output import StructuredOutputsParams

pytestmark = pytest.mark.text

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["receipt", "form", "chart"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "box": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 999},
                                                 "ok": {"type": "boolean"}},
                "required": ["x", "ok"], "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "box"],
    "additionalProperties": False,
}
KW = dict(dtype="float32", max_model_len=512, kv_cache_memory=32 << 20)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen2"][0]), **KW)


def _json_params(seed: int, schema=SCHEMA, max_tokens: int = 200, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs={"json": schema}, **kw)


def test_json_schema_many_seeds_parse_and_validate(llm):
    outs = llm.generate(["Extract the receipt:"] * 12, [_json_params(s) for s in range(12)], use_tqdm=False)
    texts = set()
    for o in outs:
        assert o.finish_reason == "stop", (o.text, o.error)
        value = json.loads(o.text)
        jsonschema.validate(value, SCHEMA)
        assert 1 <= len(value["tags"]) <= 3 and value["kind"] in ("receipt", "form", "chart")
        texts.add(o.text)
    assert len(texts) > 6  # the seeds differ: the grammar does not force one answer
    assert not llm.engine.structured_output_manager._requests  # every grammar state dropped


def test_regex_and_choice(llm):
    regex = r"[0-9]{3}-[a-z]{2,4}( [A-Z][a-z]{1,5})?"
    choices = ["yes", "no", "not sure"]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs={"regex": regex})
              for s in range(6)]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=10, structured_outputs={"choice": choices})
               for s in range(6)]
    outs = llm.generate(["Answer:"] * 12, params, use_tqdm=False)
    for o in outs[:6]:
        assert o.finish_reason == "stop" and re.fullmatch(regex, o.text), o.text
    for o in outs[6:]:
        assert o.finish_reason == "stop" and o.text in choices, o.text
    assert len({o.text for o in outs[6:]}) > 1


def test_json_object_pydantic_and_grammar(llm):
    class Item(pydantic.BaseModel):
        label: str = pydantic.Field(max_length=6)
        count: int = pydantic.Field(ge=0, le=99)

    lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9][0-9]?/'
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_outputs={"json_object": True})
              for s in range(3)]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs={"json": Item})
               for s in range(3)]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs={"grammar": lark})
               for s in range(3)]
    outs = llm.generate(["Go:"] * 9, params, use_tqdm=False)
    for o in outs[:3]:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:  # an unbounded object may run out of tokens: a prefix of one, cut by length
            assert o.finish_reason == "length" and o.text.startswith("{")
    for o in outs[3:6]:
        assert o.finish_reason == "stop"
        Item.model_validate_json(o.text)
    for o in outs[6:]:
        assert o.finish_reason == "stop" and re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", o.text), o.text


def test_bad_specs_refused_at_creation():
    with pytest.raises(ValueError, match="strin"):
        SamplingParams(structured_outputs={"json": {"type": "object", "properties": {"a": {"type": "strin"}}}})
    with pytest.raises(ValueError, match="weird-format"):
        StructuredOutputsParams(json={"type": "string", "format": "weird-format"})
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="regex"):
        StructuredOutputsParams(regex="[a-z")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="unexpected keyword"):
        SamplingParams(structured_outputs={"json_schema": {}})
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs=42)
    sp = SamplingParams()
    with pytest.raises(ValueError, match="unknown name"):  # checked on assignment too
        sp.structured_outputs = {"grammar": "start: foo"}


def test_mixed_batch_joining_at_different_steps(llm):
    """Unconstrained A, then constrained B two steps later, then unconstrained C: A and C
    equal their runs alone (their rows untouched), B is valid."""
    eng = llm.engine
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(["The first prompt", "A third one here"], free, use_tqdm=False)]
    outs: dict[str, object] = {}
    a = eng.add_request("The first prompt", free)
    for step in range(400):
        if step == 2:
            b = eng.add_request("Second:", _json_params(7))
        if step == 5:
            c = eng.add_request("A third one here", free)
        for o in eng.step():
            outs[o.request_id] = o
        if step > 5 and not eng.has_unfinished_requests():
            break
    assert outs[a].token_ids == alone[0] and outs[c].token_ids == alone[1]
    assert outs[b].finish_reason == "stop"
    jsonschema.validate(json.loads(outs[b].text), SCHEMA)


def test_eos_only_where_the_grammar_accepts(llm):
    """EOS pushed to the top of every row: the constrained request still ends in a whole
    object (finish "stop"), the unconstrained one stops at once."""
    eos = sorted(llm.engine.eos_token_ids)

    def push_eos(chunks, inp, logits, sampled):
        logits[:, eos] += 1e4

    llm.engine.runner.observers.append(push_eos)
    try:
        outs = llm.generate(["x", "y"], [_json_params(3), SamplingParams(temperature=0, max_tokens=8)],
                            use_tqdm=False)
    finally:
        llm.engine.runner.observers.remove(push_eos)
    assert outs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert outs[1].finish_reason == "stop" and len(outs[1].token_ids) == 1 and outs[1].token_ids[0] in eos


def test_max_tokens_mid_object_is_length_with_partial_text(llm):
    (out,) = llm.generate(["x"], [_json_params(1, max_tokens=5)], use_tqdm=False)
    assert out.finish_reason == "length" and out.error is None and len(out.token_ids) == 5
    assert out.text.startswith('{"name": "')
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_ids_past_the_tokenizer_never_allowed(llm):
    """The logits (151936) are wider than the tokenizer (151669): with those ids pushed to
    the top, the unconstrained row samples one, the constrained row never does."""
    n_tok = len(llm.tokenizer)
    width = llm.engine.vocab_size
    assert width > n_tok

    def push_tail(chunks, inp, logits, sampled):
        logits[:, n_tok:] += 1e4

    llm.engine.runner.observers.append(push_tail)
    try:
        outs = llm.generate(["x", "y"], [_json_params(5), SamplingParams(temperature=0, max_tokens=3)],
                            use_tqdm=False)
    finally:
        llm.engine.runner.observers.remove(push_tail)
    assert all(t >= n_tok for t in outs[1].token_ids)
    assert outs[0].finish_reason == "stop" and all(t < n_tok for t in outs[0].token_ids)
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)


def test_bitmask_layout_and_width(llm):
    from atlas_vlm.structured_output.backend import apply_token_bitmask

    mgr = llm.engine.structured_output_manager
    grammar = mgr.backend.compile_grammar(StructuredOutputsParams(choice=["yes", "no"]))
    bitmask = torch.zeros(1, (mgr.backend.mask_vocab_size + 31) // 32, dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    allowed = apply_token_bitmask(torch.zeros(1, llm.engine.vocab_size), bitmask)[0].isfinite()
    ids = allowed.nonzero()[:, 0].tolist()
    assert ids and max(ids) < len(llm.tokenizer)
    texts = {llm.tokenizer.decode([i]) for i in ids}
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts), texts


def test_logprobs_of_the_masked_distribution(llm):
    (out,) = llm.generate(["x"], [SamplingParams(temperature=0, max_tokens=10, logprobs=20,
                                                 structured_outputs={"choice": ["alpha", "beta"]})], use_tqdm=False)
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"
    for lp, top in zip(out.logprobs, out.top_logprobs):
        assert lp <= 0.0 and all(v <= 0.0 for v in top.values())
    # the first token: only the two choices' first tokens carry probability
    assert sum(torch.tensor(list(out.top_logprobs[0].values())).exp().tolist()) == pytest.approx(1.0, abs=1e-4)


def test_preemption_resumes_the_matcher(tiny_models):
    """A KV cache of 12 blocks of 16 for 4 requests growing to 70-100 tokens forces preemption
    by recompute: outputs are valid and equal those of a roomy cache (greedy)."""
    folder = str(tiny_models["qwen2"][0])
    schema = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 20, "maxItems": 20}
    params = [SamplingParams(temperature=0, max_tokens=150, structured_outputs={"json": schema})] * 4
    prompts = [f"Colors {i}: " * 3 for i in range(4)]
    roomy = LLM(folder, **KW).generate(prompts, params, use_tqdm=False)
    tight = LLM(folder, **{**KW, "num_kvcache_blocks": 12})
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for o, r in zip(outs, roomy):
        assert o.finish_reason == "stop" and o.token_ids == r.token_ids
        jsonschema.validate(json.loads(o.text), schema)


def test_smollm2_gguf_tokenizer_bytes_and_schema():
    """The embedded SmolLM2 (real weights): its GGUF-converted tokenizer's decoder mixes
    SentencePiece steps into byte-level BPE; the grammar library must still see ``Ġ"`` as
    the bytes ' "' (it once read 'Ġ' literally and allowed tokens by the wrong bytes)."""
    from atlas_vlm.structured_output.backend import GuidanceBackend

    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory=64 << 20)
    tok = llm.tokenizer
    backend = GuidanceBackend(tok, llm.engine.vocab_size, llm.engine.eos_token_ids)
    text = ' "hello world", {"a": 1}'
    assert backend.ll_tokenizer.tokenize_str(text) == tok.encode(text, add_special_tokens=False)
    for t in tok.encode(text, add_special_tokens=False):
        assert backend.ll_tokenizer.decode_bytes([t]) == tok.decode([t]).encode()
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "nights": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "nights"], "additionalProperties": False}
    outs = llm.chat([[{"role": "user", "content": "A trip to Paris as JSON."}]] * 4,
                    [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs={"json": schema})
                     for s in range(4)], use_tqdm=False)
    for o in outs:
        assert o.finish_reason == "stop", (o.text, o.error)
        jsonschema.validate(json.loads(o.text), schema)


def test_only_the_manager_touches_grammar_state():
    """One owner: the grammar library and its matchers appear only in
    ``atlas_vlm/structured_output``; ``Request`` carries no grammar field."""
    import dataclasses

    from helpers import REPO

    from atlas_vlm.request import Request

    use = re.compile(r"llguidance|LLMatcher|consume_token|fill_bitmask|\.grammar\.|_requests\[")
    offenders = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
                 for p in sorted((REPO / "atlas_vlm").rglob("*.py")) if "structured_output" not in p.parts
                 for i, line in enumerate(p.read_text().splitlines(), 1) if use.search(line)]
    assert offenders == []
    assert not [f.name for f in dataclasses.fields(Request) if re.search("grammar|matcher|structured", f.name)]
