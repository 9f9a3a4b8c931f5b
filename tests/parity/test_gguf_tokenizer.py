"""The embedded SmolLM2's tokenizer follows its GGUF header (issue 7, example 6): the header
is read here with the ``gguf`` package, independently of the loader, and the tokenizer the
engine loads is checked against it: BOS/EOS/PAD/UNK tokens and ids, ``add_bos_token`` (false:
no BOS prepended, as llama.cpp tokenizes), ``add_eos_token``, the chat template and
``clean_up_tokenization_spaces`` (llama.cpp turns it off for the ``smollm`` pre-tokenizer)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import gguf
import pytest

from atlas_vlm import LLM
from atlas_vlm.default_models import default_text_model
from atlas_vlm.loader import eos_token_ids, gguf_to_folder
from atlas_vlm.tokenizer import apply_gguf_tokenizer_settings, gguf_tokenizer_settings

pytestmark = pytest.mark.text

PROMPTS = [  # the five prompts of test_real_weights.py
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colors:",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def header() -> dict:
    fields = gguf.GGUFReader(default_text_model()).fields
    wanted = ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
              "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.unknown_token_id",
              "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.chat_template"]
    out = {k: fields[k].contents() for k in wanted if k in fields}
    out["tokens"] = fields["tokenizer.ggml.tokens"].contents()
    return out


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=128, kv_cache_memory=16 << 20, dtype="float32")


def test_header_states_what_the_issue_says(header):
    assert header["tokenizer.ggml.model"] == "gpt2" and header["tokenizer.ggml.pre"] == "smollm"
    assert header["tokenizer.ggml.add_bos_token"] is False
    assert "tokenizer.ggml.add_eos_token" not in header  # llama.cpp default for BPE: no EOS added
    assert header["tokens"][header["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"


def test_special_tokens_follow_the_header(llm, header):
    tok = llm.tokenizer
    tokens = header["tokens"]
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id"),
                      ("unk", "unknown_token_id")):
        gguf_id = header[f"tokenizer.ggml.{key}"]
        assert getattr(tok, f"{name}_token_id") == gguf_id, name
        assert getattr(tok, f"{name}_token") == tokens[gguf_id], name
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.add_bos_token is header["tokenizer.ggml.add_bos_token"] is False
    assert tok.add_eos_token is False
    assert tok.clean_up_tokenization_spaces is False
    assert tok.chat_template == header["tokenizer.chat_template"]


def test_eos_set_from_one_place(llm, header):
    engine = llm.engine
    eos = header["tokenizer.ggml.eos_token_id"]
    assert engine.eos_token_ids == eos_token_ids(engine.tokenizer, gguf_to_folder(Path(default_text_model()))) == {eos}


def test_prompt_ids_follow_llama_cpp_rules(llm, header):
    """llama.cpp's ``llama_tokenize(add_special=True)`` prepends BOS only if add_bos is set;
    here it is not, so the prompt is its text's tokens alone, and no EOS is appended."""
    tok, bos = llm.tokenizer, header["tokenizer.ggml.bos_token_id"]
    for prompt in PROMPTS:
        ids = llm.engine.process_prompt(prompt).prompt_token_ids
        assert ids == tok(prompt, add_special_tokens=False)["input_ids"], prompt
        assert ids[0] != bos and ids[-1] != header["tokenizer.ggml.eos_token_id"]
        assert tok.decode(ids) == prompt
    assert llm.engine.process_prompt("The capital of France is").prompt_token_ids[0] != 1


def test_decode_keeps_spaces_as_written(llm):
    tok = llm.tokenizer
    text = "Hello , world . Isn 't it ?"
    assert tok.decode(tok(text)["input_ids"]) == text  # clean-up would give "Hello, world. Isn't it?"


def test_converted_folder_is_not_a_stale_one():
    folder = gguf_to_folder(Path(default_text_model()))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is False and config["eos_token"] == "<|im_end|>"
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2


def test_settings_resolved_from_the_header(header):
    s = gguf_tokenizer_settings(default_text_model())
    assert (s.model, s.pre, s.add_bos_token, s.add_eos_token, s.clean_up_tokenization_spaces) == (
        "gpt2", "smollm", False, False, False)
    assert s.token_ids == {"bos": 1, "eos": 2, "unk": 0, "pad": 2}
    assert s.tokens == {k: header["tokens"][i] for k, i in s.token_ids.items()}
    assert s.chat_template == header["tokenizer.chat_template"]


def test_a_tokenizer_that_ignores_add_bos_is_refused():
    class IgnoresAddBos:
        """A tokenizer class that takes ``add_bos_token`` but never prepends BOS (as some do)."""

        bos_token = eos_token = unk_token = pad_token = chat_template = None

        def __call__(self, text):
            return {"input_ids": [64]}  # "a", with no BOS whatever add_bos_token says

    wants_bos = replace(gguf_tokenizer_settings(default_text_model()), tokens={"bos": "<|endoftext|>"},
                        token_ids={"bos": 151643}, add_bos_token=True, chat_template=None)
    with pytest.raises(ValueError, match="IgnoresAddBos does not follow the GGUF's add_bos_token=True"):
        apply_gguf_tokenizer_settings(IgnoresAddBos(), wants_bos)
