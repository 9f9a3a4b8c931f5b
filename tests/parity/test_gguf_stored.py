"""A ``.gguf`` loaded as stored (the default): every quantized tensor a layer on the mapped
file's bytes, values exactly ``gguf``'s dequantization, the same greedy tokens as the dense copy
(``quantization="dequantize"``) where every layer multiplies dequantized weights, RSS after the
load bounded by the file's size (not by its dense size), and nothing written to the cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from test_gguf_types import HIDDEN, INTER, LAYER_TYPES, _dense, write_gguf

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.layers.gguf_linear import GGUFLinear
from atlas_vlm.layers.gguf_stored import GGUFDequantLinear, GGUFEmbedding, GGUFFusedLinear
from atlas_vlm.loader import load_model

pytestmark = pytest.mark.text

PROMPTS = [[1, 504, 3458, 282, 4649, 30], [1, 9519, 253, 7049, 9, 288, 1312]]


def _in_mapping_of(ptr: int, path) -> bool:
    """Whether address ``ptr`` lies in a memory mapping of file ``path`` (``/proc/self/maps``)."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, *rest = line.split()
            lo, hi = (int(x, 16) for x in span.split("-"))
            if rest and rest[-1] == str(path) and lo <= ptr < hi:
                return True
    return False


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    path = tmp_path_factory.mktemp("stored") / "tiny-mixed.gguf"
    write_gguf(path, LAYER_TYPES)
    return path


def test_layers_are_the_files_bytes(mixed, tmp_path, monkeypatch):
    monkeypatch.setenv("ATLAS_VLM_CACHE", str(tmp_path / "cache"))
    loaded = load_model(mixed)
    written = sorted(p.relative_to(tmp_path / "cache").parts[0] for p in (tmp_path / "cache").rglob("*") if p.is_file())
    assert set(written) <= {"kernels"}  # no dense copy, no config folder: only the C kernels built here
    assert loaded.model_dir == mixed
    stored = {t.name: t for t in GGUFReader(str(mixed)).tensors}
    layers = loaded.model.model.layers
    qkv0 = layers[0].self_attn.qkv_proj  # Q4_K q, k beside a Q6_K v: each on its own bytes
    assert isinstance(qkv0, GGUFFusedLinear) and [p.qtype for p in qkv0.parts] == ["Q4_K", "Q4_K", "Q6_K"]
    v = stored["blk.0.attn_v.weight"]  # the file's pages, not a copy
    assert isinstance(qkv0.parts[2], GGUFLinear) and _in_mapping_of(qkv0.parts[2].blocks.data_ptr(), mixed.resolve())
    assert torch.equal(qkv0.parts[2].blocks, torch.from_numpy(np.array(v.data)).view(128, -1))
    gate_up0 = layers[0].mlp.gate_up_proj  # Q4_K + Q4_K: one layer, rows concatenated once
    assert isinstance(gate_up0, GGUFLinear) and gate_up0.out_features == 2 * INTER
    packed = gate_up0.packed is not None  # interleaved rows run; the concatenated copy is not kept
    assert (gate_up0.blocks is None) if packed else not _in_mapping_of(gate_up0.blocks.data_ptr(), mixed.resolve())
    up1 = layers[1].mlp.gate_up_proj  # Q5_1 + IQ4_NL: no stored-block kernel: dense copies, made once
    assert isinstance(up1, GGUFFusedLinear) and all(type(p) is torch.nn.Linear for p in up1.parts)
    assert not any(isinstance(m, GGUFDequantLinear) for m in loaded.model.modules())
    for i, layer in enumerate(layers):  # every weight exactly gguf's dequantization
        for part, mod in (("ffn_down", layer.mlp.down_proj), ("attn_output", layer.self_attn.o_proj)):
            t = stored[f"blk.{i}.{part}.weight"]
            x = torch.randn(3, int(t.shape[0]))
            want = x @ _dense(np.asarray(t.data), t.tensor_type.name, int(t.shape[0])).T
            got = mod(x)
            tol = 0 if type(mod) is torch.nn.Linear else 0.02  # the kernel's int8 activations
            assert (got - want).abs().max() <= tol * want.abs().max() + 1e-6, (i, part)
    emb = loaded.model.model.embed_tokens  # tied Q4_K table: rows dequantized on lookup
    assert isinstance(emb, GGUFEmbedding) and isinstance(loaded.model.lm_head, GGUFLinear)
    assert loaded.model.lm_head.blocks.data_ptr() == emb.blocks.data_ptr()
    ids = torch.tensor([0, 7, 49151])
    table = _dense(np.asarray(stored["token_embd.weight"].data), "Q4_K", HIDDEN)
    assert torch.equal(emb(ids), table[ids])


def test_rss_after_load_is_bounded_by_the_file(tmp_path, monkeypatch):
    """A Q4_K / Q6_K file of 18 MB (dense fp32: 107 MB) adds at most its size plus 20 MB of
    RSS (rows concatenated, norms, the tokenizer), and writes nothing to the cache."""
    monkeypatch.setenv("ATLAS_VLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "q4k.gguf"
    write_gguf(path, [LAYER_TYPES[0]] * 24, seed=1)
    size = path.stat().st_size
    load_model(path)  # warm: tokenizer tables, kernels, imports
    before = _rss_bytes()
    loaded = load_model(path)
    grown = _rss_bytes() - before
    dense = sum(int(np.prod([int(d) for d in t.shape])) * 4 for t in GGUFReader(str(path)).tensors)
    assert dense > 5 * size  # the bound below could not hold for a dense copy
    assert grown <= size + 20 * 2**20, (grown, size)
    assert not (tmp_path / "cache").exists()
    del loaded


def test_as_stored_is_the_default_and_matches_the_dense_copy(mixed):
    """Greedy tokens of the as-stored load equal the dense copy's (``dequantize``): the
    stored-block kernels' int8 activations may part at a near-tie, so the first tokens are held."""
    stored = LLM(str(mixed), dtype="float32", max_model_len=256)
    dense = LLM(str(mixed), quantization="dequantize", dtype="float32", max_model_len=256)
    assert isinstance(stored.engine.runner.model.model.embed_tokens, GGUFEmbedding)
    assert isinstance(dense.engine.runner.model.model.embed_tokens, torch.nn.Embedding)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a = [o.token_ids for o in stored.generate(PROMPTS, params, use_tqdm=False)]
    b = [o.token_ids for o in dense.generate(PROMPTS, params, use_tqdm=False)]
    assert [x[:2] for x in a] == [y[:2] for y in b], (a, b)


def test_header_config_and_tokenizer_equal_transformers_own():
    """Config and tokenizer built from our parsed header equal transformers' own GGUF loading of
    the embedded SmolLM2 (which re-reads the header): every config field, the tokens of mixed
    text, special tokens, the chat template's output."""
    from pathlib import Path

    from transformers import AutoConfig, AutoTokenizer

    from atlas_vlm.checkpoint import read_gguf
    from atlas_vlm.default_models import default_text_model
    from atlas_vlm.quantization.gguf_meta import gguf_config, gguf_tokenizer
    from atlas_vlm.tokenizer import apply_gguf_tokenizer_settings, gguf_tokenizer_settings

    path = Path(default_text_model())
    reader = read_gguf(path)
    ours = gguf_config(reader, path)
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    drop = {"_name_or_path"}  # theirs names the folder it read
    assert {k: v for k, v in ours.to_dict().items() if k not in drop} == \
        {k: v for k, v in theirs.to_dict().items() if k not in drop}
    settings = gguf_tokenizer_settings(path, reader.fields)
    a = gguf_tokenizer(reader, ours, settings)
    b = apply_gguf_tokenizer_settings(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), settings)
    for text in ["hello world def foo():\n  return 1", "  Ünïcödé 日本語 <|im_start|>user\nhi<|im_end|>"]:
        assert a(text)["input_ids"] == b(text)["input_ids"]
    msgs = [{"role": "user", "content": "hi there"}]
    assert a.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
        b.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert (type(a), a.bos_token, a.eos_token, a.pad_token, len(a)) == (type(b), b.bos_token, b.eos_token, b.pad_token,
                                                                         len(b))
