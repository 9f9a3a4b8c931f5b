"""Both config layouts of RoPE settings, read through one function (``layers.rotary.rope_parameters``):
transformers 5's ``rope_parameters`` and 4.x's ``rope_scaling`` + ``rope_theta``, at the top
level or under ``text_config``. Each family's tiny checkpoint rewritten in the other layout
loads to the same decoder (RoPE tables, M-RoPE section) and the same greedy tokens; a family
that needs M-RoPE without a section is refused at load with the key named."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.layers.rotary import rope_parameters
from atlas_vlm.models.arch import ModelArch

pytestmark = pytest.mark.text

FAMILIES = ["qwen2", "llama", "qwen3", "qwen2_vl", "qwen2_5_vl"]  # + qwen3_vl, smolvlm below


@pytest.mark.parametrize("config, expected", [
    (SimpleNamespace(rope_parameters={"rope_theta": 5e5, "rope_type": "default"}),
     {"rope_theta": 5e5, "rope_type": "default"}),
    (SimpleNamespace(rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, rope_theta=1e6),
     {"rope_theta": 1e6, "rope_type": "default", "mrope_section": [2, 3, 3]}),
    (SimpleNamespace(rope_scaling=None, rope_theta=1e4), {"rope_theta": 1e4, "rope_type": "default"}),
    (SimpleNamespace(), {"rope_theta": 10000.0, "rope_type": "default"}),  # HF's default_theta
    (SimpleNamespace(rope_scaling={"rope_type": "llama3", "factor": 8.0}, rope_theta=5e5),
     {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}),
    # a VLM: the text config's own settings win, the outer config fills what it lacks
    (SimpleNamespace(text_config=SimpleNamespace(rope_parameters={"rope_theta": 1e6}),
                     rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
     {"rope_theta": 1e6, "rope_type": "default", "mrope_section": [16, 24, 24]}),
    (SimpleNamespace(text_config={"rope_scaling": {"mrope_section": [1, 1, 2]}, "rope_theta": 3.0}),
     {"rope_theta": 3.0, "rope_type": "default", "mrope_section": [1, 1, 2]}),
])
def test_rope_parameters_reads_every_layout(config, expected):
    assert rope_parameters(config) == expected


def _old_layout(cfg: dict) -> dict:
    """transformers 4.x's layout of the same settings: ``rope_scaling`` + ``rope_theta``."""
    out = dict(cfg)
    params = dict(out.pop("rope_parameters", None) or {})
    out["rope_theta"] = params.pop("rope_theta", 10000.0)
    if "mrope_section" in params:
        params["type"] = "mrope"
    out["rope_scaling"] = params if set(params) - {"rope_type"} else None
    return out


def _rewrite(src, dst, how):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if "text_config" in cfg:
        cfg["text_config"] = how(cfg["text_config"])
    else:
        cfg = how(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _greedy(folder) -> tuple[list[int], torch.Tensor, tuple | None]:
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=64, num_kvcache_blocks=16)
    out = llm.generate([{"prompt_token_ids": [151644, 100, 200, 300, 400]}],
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    model = llm.engine.runner.model
    return out.token_ids, model.model.rotary.inv_freq, model.arch.mrope_section


@pytest.fixture(scope="module")
def tiny_vlm_folders(tmp_path_factory):
    """Qwen3-VL and SmolVLM2 tiny checkpoints (tests/tiny_vlms.py), built once here."""
    from tiny_vlms import build_tiny_qwen3_vl, build_tiny_smolvlm

    folders = {}
    for name, build in (("qwen3_vl", build_tiny_qwen3_vl), ("smolvlm", build_tiny_smolvlm)):
        folders[name] = tmp_path_factory.mktemp(name)
        build(folders[name])
    return folders


@pytest.mark.parametrize("family", [*FAMILIES, "qwen3_vl", "smolvlm"])
def test_both_layouts_load_the_same_model(tiny_models, tiny_vlm_folders, tmp_path, family):
    folder = tiny_vlm_folders[family] if family in tiny_vlm_folders else tiny_models[family][0]
    saved = json.loads((folder / "config.json").read_text())
    assert "rope_parameters" in saved.get("text_config", saved)  # transformers 5 writes the new layout
    old = _rewrite(folder, tmp_path / "old", _old_layout)
    rewritten = json.loads((old / "config.json").read_text())
    rewritten = rewritten.get("text_config", rewritten)
    assert "rope_theta" in rewritten and "rope_scaling" in rewritten and "rope_parameters" not in rewritten
    new_tokens, new_freq, new_section = _greedy(folder)
    old_tokens, old_freq, old_section = _greedy(old)
    assert new_tokens == old_tokens and torch.equal(new_freq, old_freq) and new_section == old_section
    assert (new_section is not None) == family.endswith("_vl")  # M-RoPE: the Qwen VLMs; SmolVLM's decoder is 1-D


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_m_rope_without_a_section_is_refused(tiny_models, tmp_path, family):
    folder, _ = tiny_models[family]

    def drop_section(cfg):
        cfg = dict(cfg)
        cfg["rope_parameters"] = {k: v for k, v in cfg["rope_parameters"].items() if k not in ("mrope_section", "type")}
        return cfg

    broken = _rewrite(folder, tmp_path / "broken", drop_section)
    with pytest.raises(ValueError, match=r"needs M-RoPE but its config has no mrope_section: set "
                                         r"text_config.rope_parameters\['mrope_section'\]"):
        LLM(str(broken), dtype="float32", device="cpu", max_model_len=64, num_kvcache_blocks=16)


def test_qwen3_vl_without_a_section_takes_hfs_default():
    from transformers import Qwen3VLConfig

    config = Qwen3VLConfig(architectures=["Qwen3VLForConditionalGeneration"])
    assert "mrope_section" not in rope_parameters(config)
    assert ModelArch.from_hf_config(config).mrope_section == (24, 20, 20)  # Qwen3VLTextRotaryEmbedding's default
