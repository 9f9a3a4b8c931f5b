"""GGUF repos from the Hub as llama.cpp's ``-hf`` takes them: the quant tag / ``hf_file`` pick
on a listing, the mmproj pairing, a split file read as one, and a load through a stand-in Hub on
127.0.0.1 (``tests/hub_stand_in.py``; ``huggingface_hub`` pointed at it), then offline from its
cache. No test reaches the network."""

from __future__ import annotations

import pytest
import torch

from helpers import record
from hub_stand_in import COMMIT, StandInHub, write_tiny_gguf

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.hub import looks_like_repo_id, resolve_model, split_tag
from atlas_vlm.hub_gguf import quant_tag, select_gguf
from atlas_vlm.loader import ModelNotFoundError

pytestmark = pytest.mark.text

LISTING = ["README.md", ".gitattributes", "Qwen2-VL-2B-Instruct-IQ4_XS.gguf", "Qwen2-VL-2B-Instruct-Q4_K_M.gguf",
           "Qwen2-VL-2B-Instruct-Q4_K_S.gguf", "Qwen2-VL-2B-Instruct-Q8_0.gguf", "Qwen2-VL-2B-Instruct-f16.gguf",
           "mmproj-Qwen2-VL-2B-Instruct-f16.gguf", "mmproj-Qwen2-VL-2B-Instruct-Q8_0.gguf",
           "big/Qwen2-VL-2B-Instruct-Q6_K-00001-of-00002.gguf", "big/Qwen2-VL-2B-Instruct-Q6_K-00002-of-00002.gguf"]


@pytest.mark.parametrize("tag, want", [
    ("Q4_K_M", "Qwen2-VL-2B-Instruct-Q4_K_M.gguf"), ("q4_k_m", "Qwen2-VL-2B-Instruct-Q4_K_M.gguf"),
    ("Q4_K_S", "Qwen2-VL-2B-Instruct-Q4_K_S.gguf"), ("iq4_xs", "Qwen2-VL-2B-Instruct-IQ4_XS.gguf"),
    ("Q8_0", "Qwen2-VL-2B-Instruct-Q8_0.gguf"), ("F16", "Qwen2-VL-2B-Instruct-f16.gguf"),
    (None, "Qwen2-VL-2B-Instruct-Q4_K_M.gguf")])
def test_tag_picks_the_file_case_insensitively(tag, want):
    assert select_gguf(LISTING, tag).parts == [want]


def test_no_tag_without_q4_k_m_takes_the_first_gguf_and_hf_file_wins():
    assert select_gguf(["b-Q8_0.gguf", "a-Q5_K_M.gguf", "x.bin"]).parts == ["a-Q5_K_M.gguf"]
    assert select_gguf(LISTING, "Q8_0", hf_file="Qwen2-VL-2B-Instruct-IQ4_XS.gguf").parts == \
        ["Qwen2-VL-2B-Instruct-IQ4_XS.gguf"]
    with pytest.raises(ValueError, match="hf_file 'nope.gguf' is not in"):
        select_gguf(LISTING, hf_file="nope.gguf")


def test_missing_tag_lists_the_tags_the_repo_has():
    with pytest.raises(ValueError) as e:
        select_gguf(LISTING, "Q3_K_L", repo_id="org/Qwen2-VL-2B-Instruct-GGUF")
    assert str(e.value) == ("org/Qwen2-VL-2B-Instruct-GGUF has no .gguf of quant tag 'Q3_K_L'; its tags: "
                            "F16, IQ4_XS, Q4_K_M, Q4_K_S, Q6_K, Q8_0")
    with pytest.raises(ValueError, match="Q4_K"):  # Q4_K is no prefix match of Q4_K_M / Q4_K_S
        select_gguf(LISTING, "Q4_K")


def test_split_parts_and_mmproj_pairing():
    got = select_gguf(LISTING, "Q6_K")  # a split file: every part, in order
    assert got.parts == ["big/Qwen2-VL-2B-Instruct-Q6_K-00001-of-00002.gguf",
                         "big/Qwen2-VL-2B-Instruct-Q6_K-00002-of-00002.gguf"]
    assert got.mmproj == "mmproj-Qwen2-VL-2B-Instruct-f16.gguf"  # no Q6_K mmproj: the F16 one
    assert select_gguf(LISTING, "Q8_0").mmproj == "mmproj-Qwen2-VL-2B-Instruct-Q8_0.gguf"  # the model's quant
    assert select_gguf(["m-Q4_K_M.gguf"]).mmproj is None  # a text repo
    assert select_gguf(["m-Q4_K_M.gguf", "gemma-mmproj-bf16.gguf", "mmproj-F32.gguf"]).mmproj == "gemma-mmproj-bf16.gguf"
    with pytest.raises(ValueError, match="missing from the repo: m-Q8_0-00002-of-00002.gguf"):
        select_gguf(["m-Q8_0-00001-of-00002.gguf"], "Q8_0")
    assert quant_tag("x/Model-UD-Q4_K_XL-00001-of-00002.gguf") == "UD-Q4_K_XL" and quant_tag("model.gguf") is None


def test_repo_id_with_a_tag():
    assert looks_like_repo_id("org/Name-GGUF:Q4_K_M") and split_tag("org/Name-GGUF:q8_0") == ("org/Name-GGUF", "q8_0")
    assert not looks_like_repo_id("org/a/b:Q4") and split_tag("org/Name") == ("org/Name", None)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A stand-in Hub serving a text GGUF repo (one Q8_0 file, the same model split in 3 parts)
    and a VLM-like repo (a model and two mmproj files: bytes only, never loaded)."""
    d = tmp_path_factory.mktemp("hub_files")
    one = write_tiny_gguf(d / "tiny-Q8_0.gguf")
    parts = write_tiny_gguf(d / "tiny-Q6_K.gguf", split_max_tensors=8)  # named Q6_K: its own tag to pick by
    repos = {"org/tiny-GGUF": {p.name: p.read_bytes() for p in one + parts},
             "org/vlm-GGUF": {"vlm-Q4_K_M.gguf": b"m", "mmproj-vlm-F16.gguf": b"p", "mmproj-vlm-Q8_0.gguf": b"q"}}
    with StandInHub(repos) as hub:
        yield hub, one[0], parts


@pytest.fixture
def hub_env(served, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    hub = served[0]
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)  # read once at import
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return served


def _logits(llm, prompt):
    with record(llm) as rec:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    return out.token_ids, torch.stack(rec.sampled_logits(out.request_id))


def test_split_gguf_through_the_hub_loads_as_the_unsplit_file(hub_env, monkeypatch):
    hub, one, parts = hub_env
    small = dict(quantization="gguf", dtype="float32", max_model_len=128, num_kvcache_blocks=16)
    llm = LLM("org/tiny-GGUF:q6_k", **small)  # the split file, by its tag, downloaded (all parts) and merged
    snapshot = f"models--org--tiny-GGUF/snapshots/{COMMIT}"
    fetched = sorted(p for m, p in hub.requests if m == "GET" and "/resolve/" in p)
    assert fetched == [f"/org/tiny-GGUF/resolve/{COMMIT}/{p.name}" for p in parts]
    prompt = [1, 504, 3458, 282, 4649]
    ids, logits = _logits(llm, prompt)
    want_ids, want_logits = _logits(LLM(str(one), **small), prompt)
    assert ids == want_ids and torch.equal(logits, want_logits)
    # offline (and with the stand-in unreachable), the cache serves
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seen = len(hub.requests)
    path, mmproj = resolve_model("org/tiny-GGUF:Q6_K")
    assert str(path).endswith(f"{snapshot}/{parts[0].name}") and mmproj is None and len(hub.requests) == seen
    with pytest.raises(ModelNotFoundError) as e:  # a tag never downloaded
        resolve_model("org/tiny-GGUF:Q8_0")
    assert "no .gguf of quant tag 'Q8_0'; its tags: Q6_K" in str(e.value)
    assert 'huggingface-cli download org/tiny-GGUF --include "*Q8_0*.gguf"' in str(e.value)


def test_vlm_repo_pairs_its_mmproj(hub_env):
    path, mmproj = resolve_model("org/vlm-GGUF")
    assert path.name == "vlm-Q4_K_M.gguf" and mmproj.name == "mmproj-vlm-F16.gguf" and mmproj.read_bytes() == b"p"


def test_gguf_repo_not_cached_offline_says_what_to_do(hub_env, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as e:
        LLM("org/absent-GGUF:Q4_K_M", max_model_len=64)
    msg = str(e.value)
    assert "GGUF model 'org/absent-GGUF' is not in the Hugging Face cache" in msg and "HF_HUB_OFFLINE is set" in msg
    assert 'huggingface-cli download org/absent-GGUF --include "*Q4_K_M*.gguf" "*mmproj*"' in msg
    with pytest.raises(ModelNotFoundError, match="the Hub has no such repo"):  # online: the stand-in says 404
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        resolve_model("org/absent-GGUF")
