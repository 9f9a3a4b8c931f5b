"""Structured-output frictions found through the ``openai`` client (issue 24): a regex's
``\\d \\w \\s`` are ASCII (as xgrammar / vLLM), JSON-schema string ``format``s are enforced
where the grammar library can and refused, naming where, where it cannot."""

from __future__ import annotations

import re

import pytest

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.structured_output import StructuredOutputsParams
from atlas_vlm.structured_output.params import SUPPORTED_FORMATS, ascii_regex

pytestmark = pytest.mark.text

KW = dict(dtype="float32", max_model_len=512, kv_cache_memory=32 << 20)
FULLWIDTH_DIGITS = "０１２３４５６７８９"  # one Qwen token each; Unicode \d (category Nd)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen2"][0]), **KW)


def _accepts(llm, params: StructuredOutputsParams, text: str) -> bool:
    grammar = llm.engine.structured_output_manager.backend.compile_grammar(params)
    return all(grammar.accept_token(t) for t in llm.tokenizer.encode(text, add_special_tokens=False))


def test_ascii_regex_rewrites_perl_classes_only():
    assert ascii_regex(r"\d{3}-\d{4}") == "[0-9]{3}-[0-9]{4}"
    assert ascii_regex(r"[^\s\W]") == r"[^[\t\n\x0B\x0C\r ][^0-9A-Za-z_]]"  # nested classes (Rust syntax)
    assert ascii_regex(r"\\d\.\p{L}") == r"\\d\.\p{L}"  # an escaped backslash, other escapes kept
    assert ascii_regex(r"\w+\S\D") == "[0-9A-Za-z_]+[^\\t\\n\\x0B\\x0C\\r ][^0-9]"


def test_regex_digits_are_ascii_even_when_the_model_prefers_others(llm):
    tok = llm.tokenizer
    wide = [tok.encode(ch, add_special_tokens=False) for ch in FULLWIDTH_DIGITS]
    assert all(len(ids) == 1 for ids in wide)
    wide_ids = [ids[0] for ids in wide]

    def prefer_fullwidth(chunks, inp, logits, sampled):
        logits[:, wide_ids] += 1e4

    llm.engine.runner.observers.append(prefer_fullwidth)
    try:
        free = llm.generate(["Call"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
        outs = llm.generate(["Call"] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=20,
                                                          structured_outputs={"regex": r"\d{3}-\d{4}"})
                                           for s in range(3)], use_tqdm=False)
    finally:
        llm.engine.runner.observers.remove(prefer_fullwidth)
    assert set(free.text) <= set(FULLWIDTH_DIGITS) and free.text  # the push works without a grammar
    for out in outs:
        assert out.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.text), out.text
    assert not _accepts(llm, StructuredOutputsParams(regex=r"\d"), "٣")
    assert _accepts(llm, StructuredOutputsParams(regex=r"\d"), "3")
    assert not _accepts(llm, StructuredOutputsParams(regex=r"\w"), "é")
    assert not _accepts(llm, StructuredOutputsParams(regex=r"a\sb"), "a\u00a0b")
    assert _accepts(llm, StructuredOutputsParams(regex=r"a\sb"), "a\tb")


@pytest.mark.parametrize("fmt, good, bad", [
    ("email", "a@b.com", "nope"), ("date-time", "2024-01-02T03:04:05Z", "2024-01-02"),
    ("date", "2024-01-02", "2024-1-2"), ("time", "03:04:05Z", "3 pm"), ("duration", "P3D", "3 days"),
    ("uuid", "123e4567-e89b-12d3-a456-426614174000", "123"), ("ipv4", "10.0.0.1", "10.0.0"),
    ("ipv6", "::1", "1.2.3"), ("hostname", "example.com", "-bad-"), ("uri", "https://a.b/c", "nope")])
def test_supported_formats_are_enforced(llm, fmt, good, bad):
    assert fmt in SUPPORTED_FORMATS
    params = StructuredOutputsParams(json={"type": "string", "format": fmt})
    assert _accepts(llm, params, f'"{good}"')
    assert not _accepts(llm, params, f'"{bad}"')


def test_other_formats_refused_naming_where():
    assert len(SUPPORTED_FORMATS) == 10
    schema = {"type": "object", "properties": {"contact": {"type": "string", "format": "idn-email"}}}
    with pytest.raises(ValueError, match=r"format 'idn-email' at properties\.contact is not supported"):
        StructuredOutputsParams(json=schema)
    with pytest.raises(ValueError, match=r"format 'byte' at anyOf\[1\]"):
        StructuredOutputsParams(json={"anyOf": [{"type": "string", "format": "email"},
                                                {"type": "string", "format": "byte"}]})
    # a property called "format" and a const holding one are data, not a format keyword
    StructuredOutputsParams(json={"type": "object", "properties": {"format": {"type": "string"}},
                                  "required": ["format"], "default": {"format": "weird"}})
