"""Per-family rules live in the family's registry line and hooks (``ModelFamily`` fields,
``FamilyHooks`` in ``atlas_vlm/models/<family>/family.py``): no ``model_type`` string
comparison outside ``atlas_vlm/models/``, every hook importable, the lenient lookup the
planner uses, and every family folder packaged."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from transformers import AutoConfig, Idefics3Config, Qwen2_5_VLConfig, Qwen3Config, Qwen3VLConfig

from atlas_vlm.memory_plan import visual_tokens_per_image
from atlas_vlm.models import ModelArch
from atlas_vlm.models.family_hooks import FamilyHooks
from atlas_vlm.models.param_count import vision_params
from atlas_vlm.models.qwen2_vl.family import QwenVLHooks
from atlas_vlm.models.registry import FAMILIES, find_family, get_family, import_named, vision_hooks

pytestmark = pytest.mark.text

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "tests" / "data" / "configs"
# a model_type / family name compared as a string: == / != / in / not in / removesuffix / startswith
_COMPARISON = re.compile(r"model_type\W*\s*(==|!=|not in\b|in\b)|(==|!=)\s*[\w.]*model_type\b"
                         r"|model_type\)?\.(removesuffix|startswith|endswith)\("
                         r"|\b(fam|family)(\.name)?\s*(==|!=)\s*[\"']")


def test_no_model_type_comparisons_outside_the_family_folders():
    roots = [REPO / "atlas_vlm", REPO / "mm_token_pipeline", REPO / "mm_kv_cache_management"]
    offenders = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
                 for root in roots for p in sorted(root.rglob("*.py"))
                 if (REPO / "atlas_vlm" / "models") not in p.parents
                 for i, line in enumerate(p.read_text().splitlines(), 1) if _COMPARISON.search(line)]
    assert offenders == []


def test_the_comparison_pattern_catches_the_old_forms():
    for line in ('if cfg.model_type == "qwen3_vl":', 'if model_type not in RELEASED_DEFAULTS:',
                 'if v.model_type in ("smolvlm_vision", "idefics3_vision"):', 'kind = v.model_type.removesuffix("_vision")',
                 'mrope_interleaved=fam.name == "qwen3_vl",', 'if family != "qwen2_vl":'):
        assert _COMPARISON.search(line), line
    assert not _COMPARISON.search('family = self.hf_config.model_type')


class _NoTower:  # a config without vision_config: a text family's hooks count no tower
    vision_config = None


_CONFIG_WITHOUT_TOWER = _NoTower()


def test_every_hook_of_every_line_imports():
    for fam in FAMILIES:
        for path in (fam.model_cls, fam.mm_inputs, fam.vision_tower, fam.hooks):
            if path:
                assert import_named(path)
        hooks = fam.family_hooks()
        assert isinstance(hooks, FamilyHooks) and hooks is fam.family_hooks()  # one instance
        assert fam.hooks is not None or not fam.multimodal  # a VLM states its tower's sizes
        if not fam.multimodal:
            assert hooks.vision_params(_CONFIG_WITHOUT_TOWER) == 0
        if fam.multimodal and fam.name != "smolvlm":  # SmolVLM reads a longest edge, not pixel bounds
            assert 0 < hooks.processor_defaults["min_pixels"] <= hooks.processor_defaults["max_pixels"]


def test_mrope_fields_reach_the_arch():
    q3 = ModelArch.from_hf_config(AutoConfig.from_pretrained(CONFIGS / "Qwen3-VL-4B-Instruct"))
    q25 = ModelArch.from_hf_config(AutoConfig.from_pretrained(CONFIGS / "Qwen2.5-VL-3B-Instruct"))
    assert q3.mrope_interleaved and not q25.mrope_interleaved
    assert get_family("qwen3_vl").default_mrope_section == (24, 20, 20)
    assert get_family("qwen2_5_vl").default_mrope_section is None
    bare = Qwen3VLConfig()  # no mrope_section stated: HF's default taken
    bare.text_config.rope_parameters = {"rope_type": "default", "rope_theta": 5e6}
    assert ModelArch.from_hf_config(bare).mrope_section == (24, 20, 20)


def test_find_family_is_lenient_resolve_is_not():
    assert find_family(Qwen3Config(architectures=["Qwen3ForSequenceClassification"])).name == "qwen3"
    assert find_family(Qwen2_5_VLConfig().text_config).name == "qwen2_5_vl"  # "qwen2_5_vl_text"
    assert find_family(Idefics3Config()).name == "smolvlm"  # its SigLIP tower: the planner counted it before
    assert find_family(Idefics3Config(), by_parts=False) is None
    assert find_family(AutoConfig.for_model("gpt2")) is None


def test_vision_hooks_fall_back_to_the_qwen_geometry():
    cfg = Qwen2_5_VLConfig()
    cfg.model_type, cfg.architectures = "unknown_vl", ["UnknownVLForConditionalGeneration"]
    cfg.vision_config.model_type = "unknown_vl_vision"
    assert type(vision_hooks(cfg)) is QwenVLHooks
    assert visual_tokens_per_image(cfg, 28 * 28 * 10) == 10
    with pytest.raises(ValueError, match="no parameter count for vision tower 'unknown_vl'"):
        vision_params(cfg)


def test_every_family_folder_is_packaged():
    from setuptools import find_namespace_packages

    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find["namespaces"]
    packages = set(find_namespace_packages(where=str(REPO), include=find["include"]))
    folders = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "atlas_vlm" / "models").glob("*/__init__.py")}
    assert folders and folders <= packages
