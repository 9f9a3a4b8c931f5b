"""Hub ids (``ORG/NAME``) resolve through huggingface_hub's cache, offline: a cache folder is
laid out here (``models--org--name/snapshots/<rev>/`` + ``refs/main``) from a tiny model; no
test reaches the network."""

from __future__ import annotations

import fnmatch
import shutil

import pytest

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.hub import HUB_ALLOW_PATTERNS, looks_like_repo_id, resolve_model_path
from atlas_vlm.loader import ModelNotFoundError

pytestmark = pytest.mark.text

REV = "0123456789abcdef0123456789abcdef01234567"
REV2 = "89abcdef0123456789abcdef0123456789abcdef"
SMALL = dict(max_model_len=256, num_kvcache_blocks=16, device="cpu", dtype="float32")


def lay_out(cache, repo_id: str, rev: str, folder, ref: str | None = "main") -> None:
    """A huggingface_hub cache entry for ``repo_id`` at commit ``rev`` holding ``folder``'s files."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, repo / "snapshots" / rev)
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(rev)


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_models):
    cache = tmp_path / "hf_home" / "hub"
    lay_out(cache, "tiny-org/tiny-qwen2", REV, tiny_models["qwen2"][0])
    lay_out(cache, "tiny-org/tiny-qwen2", REV2, tiny_models["llama"][0], ref=None)  # another commit, no ref
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def greedy_ids(llm):
    return llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]


def test_hub_id_loads_from_the_cache_offline(hub, tiny_models):
    llm = LLM("tiny-org/tiny-qwen2", **SMALL)
    assert llm.engine.runner.model.arch.family == "qwen2"
    local = LLM(str(tiny_models["qwen2"][0]), **SMALL)
    assert greedy_ids(llm).token_ids == greedy_ids(local).token_ids
    assert str(resolve_model_path("tiny-org/tiny-qwen2")).endswith(f"snapshots/{REV}")


def test_revision_picks_the_commit(hub):
    llm = LLM("tiny-org/tiny-qwen2", revision=REV2, **SMALL)
    assert llm.engine.runner.model.arch.family == "llama"


def test_hf_hub_cache_wins_over_hf_home(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ModelNotFoundError, match="tiny-org/tiny-qwen2"):
        resolve_model_path("tiny-org/tiny-qwen2")


def test_local_path_wins_over_a_hub_id(hub, tmp_path, monkeypatch, tiny_models):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_models["llama"][0], tmp_path / "tiny-org" / "tiny-qwen2")
    llm = LLM("tiny-org/tiny-qwen2", **SMALL)
    assert llm.engine.runner.model.arch.family == "llama"  # the local folder, not the cached qwen2


def test_missing_model_says_how_to_get_it(hub):
    with pytest.raises(ModelNotFoundError) as e:
        LLM("tiny-org/absent", **SMALL)
    msg = str(e.value)
    assert "'tiny-org/absent'" in msg and "not in the Hugging Face cache" in msg
    assert "huggingface-cli download tiny-org/absent" in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(ModelNotFoundError, match="--revision v9"):
        resolve_model_path("tiny-org/absent", revision="v9")


def test_not_a_hub_id_is_a_missing_path(hub, tmp_path):
    for name in ("./nope", "a/b/c", "/abs/x", "~/x/y", "../x"):
        assert not looks_like_repo_id(name)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"), **SMALL)


def test_download_asks_only_for_the_files_we_read(monkeypatch, tmp_path):
    """The arguments given to ``snapshot_download`` (captured; nothing is fetched)."""
    import huggingface_hub

    seen = {}

    def fake(repo_id, **kwargs):
        seen.update(kwargs, repo_id=repo_id)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert resolve_model_path("Qwen/Qwen2.5-VL-3B-Instruct", revision="main") == tmp_path
    assert seen["repo_id"] == "Qwen/Qwen2.5-VL-3B-Instruct" and seen["revision"] == "main"
    assert seen["local_files_only"] is False and seen["cache_dir"] == str(tmp_path / "c")
    repo = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
            "merges.txt", "preprocessor_config.json", "chat_template.json", "model.safetensors.index.json",
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
            "pytorch_model.bin", "model.gguf", "README.md", ".gitattributes", "original/consolidated.pth"]
    wanted = [f for f in repo if any(fnmatch.fnmatch(f, p) for p in seen["allow_patterns"])]
    assert seen["allow_patterns"] == HUB_ALLOW_PATTERNS
    assert wanted == repo[:11]
