"""The ``OutputProcessor`` on real tokenizers (the embedded SmolLM2's, converted from its GGUF,
and the Qwen2.5 one), as loaded: over many generated id sequences (text with emoji, CJK and
clean-up punctuation, random ids that split multi-byte characters, special tokens) and stop
sets (some drawn from the decoded text), the concatenated deltas equal ``text`` at every
step, every streamed text is a prefix of the final one, and the final text is
``tokenizer.decode(ids, skip_special_tokens=True)`` cut at the first stop string."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from atlas_vlm import SamplingParams
from atlas_vlm.default_models import default_text_model
from atlas_vlm.engine.detokenizer import IncrementalDetokenizer
from atlas_vlm.engine.output_processor import OutputProcessor
from atlas_vlm.loader import gguf_to_folder
from atlas_vlm.models.qwen2_vl.tokenizer_files import qwen_tokenizer_dir

pytestmark = pytest.mark.text

ALPHABET = "abcdeEFG ABC.,!?'nts\n中文字😀🎉👍🏽éü"


@pytest.fixture(scope="module", params=["smollm2", "qwen"])
def tok(request):
    if request.param == "smollm2":
        return AutoTokenizer.from_pretrained(gguf_to_folder(Path(default_text_model())))
    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def reference(tok, ids, stops):
    """What the final output must be: the first step whose decoded text holds a stop ends
    the request, the text cut where the earliest stop starts (that stop, the first listed
    of those starting there, is its ``stop_reason``)."""
    for n in range(1, len(ids) + 1):
        text = decode(tok, ids[:n])
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            at, stop = min(hits, key=lambda h: h[0])
            return ids[:n], text[:at], "stop", stop
    return ids, decode(tok, ids), "length", None


def run(tok, ids, stops, logprobs=None):
    """Feed ``ids`` one per step as the engine does; the last one ends with "length"."""
    proc = OutputProcessor(tok)
    req = SimpleNamespace(request_id="r", finish_reason=None, error=None, logprobs=[], top_logprobs=[],
                          sampling_params=SamplingParams(stop=list(stops), logprobs=logprobs))
    proc.add_request("r", "p", [1, 2], req.sampling_params.stop)
    outs = []
    for i, t in enumerate(ids):
        if i == len(ids) - 1:
            req.finish_reason = "length"
        out, stopped = proc.process(req, [t])
        outs.append(out)
        assert stopped == (out.finish_reason == "stop" and i < len(ids) - 1)  # else the scheduler ended it
        if out.finished:
            break
    assert not proc.states, "finished request state kept"
    return outs


def check(tok, ids, stops):
    outs = run(tok, ids, stops)
    ref_ids, ref_text, ref_reason, ref_stop = reference(tok, ids, stops)
    final = outs[-1]
    assert final.token_ids == ref_ids and len(outs) == len(ref_ids)
    assert final.text == ref_text, (ids, stops)
    assert final.finish_reason == ref_reason and final.stop_reason == ref_stop
    assert all(o.stop_reason is None for o in outs[:-1])
    joined = ""
    for out in outs:
        joined += out.new_text
        assert joined == out.text  # deltas concatenate to the text at every step
        assert ref_text.startswith(out.text)  # nothing shown that a later step removes
        assert len(out.new_token_ids) == 1
    assert sum((o.new_token_ids for o in outs), []) == final.token_ids


@st.composite
def sequences(draw, tok):
    text = draw(st.text(alphabet=ALPHABET, min_size=1, max_size=40))
    ids = tok.encode(text, add_special_tokens=False) or [tok.encode("a", add_special_tokens=False)[0]]
    for _ in range(draw(st.integers(0, 3))):  # random ids: broken multi-byte runs, rare tokens
        ids.insert(draw(st.integers(0, len(ids))), draw(st.integers(0, len(tok) - 1)))
    if draw(st.booleans()):  # a special token (skipped in the text)
        ids.insert(draw(st.integers(0, len(ids))), draw(st.sampled_from(tok.all_special_ids)))
    full = decode(tok, ids)
    stops = []
    for _ in range(draw(st.integers(0, 3))):
        if full and draw(st.booleans()):
            a = draw(st.integers(0, len(full) - 1))
            stops.append(full[a:a + draw(st.integers(1, 6))])
        else:
            stops.append(draw(st.text(alphabet=ALPHABET, min_size=1, max_size=4)))
    return ids, stops


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_deltas_and_final_text_property(tok, data):
    ids, stops = data.draw(sequences(tok))
    check(tok, ids, stops)


@pytest.mark.parametrize("text", [
    "Hello world, it isn't . really ! done ?", "中文😀🎉 mixed 👍🏽 text", "a ' s n ' t x",
])
@pytest.mark.parametrize("stops", [[], ["."], ["😀"], ["n ' t", "d"], ["xyz"]])
def test_handed_cases(tok, text, stops):
    check(tok, tok.encode(text, add_special_tokens=False), stops)


def test_stop_prefix_is_held_back_until_it_cannot_match(tok):
    ids = tok.encode(" D E F G H I J", add_special_tokens=False)
    outs = run(tok, ids, ["E F G"])
    assert outs[-1].text == " D " and outs[-1].finish_reason == "stop"
    assert all("E" not in o.text for o in outs)
    outs = run(tok, ids, ["E F X"])  # never completes: the held text is released when it cannot
    assert "".join(o.new_text for o in outs) == decode(tok, ids)
    assert any(o.text.startswith(" D E F") for o in outs[:-1])


def test_window_per_step_is_flat_in_output_length(tok):
    """No whole-output re-decode: each step decodes only the ids after ``prefix_offset``,
    a window of a few ids however long the output."""
    ids = tok.encode("The quick brown fox jumps over the lazy dog. 中文 😀 " * 20, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    text, windows = "", []
    for t in ids:
        stable, pending = detok.step([t])
        text += stable
        windows.append(len(detok.token_ids) - detok.prefix_offset)
    assert len(ids) > 200 and text + pending == tok.decode(ids, skip_special_tokens=True,
                                                           clean_up_tokenization_spaces=False)
    assert max(windows) <= 8, max(windows)


def test_logprobs_and_abort_output(tok):
    proc = OutputProcessor(tok)
    req = SimpleNamespace(request_id="r", finish_reason=None, error=None, logprobs=[-0.5], top_logprobs=[{3: -0.5}],
                          sampling_params=SamplingParams(logprobs=1))
    proc.add_request("r", None, [5], [])
    ids = tok.encode("Hi there", add_special_tokens=False)
    out, _ = proc.process(req, ids[:1])
    assert out.logprobs == [-0.5] and out.top_logprobs == [{3: -0.5}] and out.prompt_token_ids == [5]
    req.finish_reason = "abort"
    final = proc.finish(req)
    assert final.finish_reason == "abort" and final.text == out.text and final.new_text == ""
    assert final.new_token_ids == [] and final.token_ids == ids[:1]
