"""The model registry: HF ``architectures`` (then ``model_type``) -> family; unsupported
checkpoints refused at load time with the supported list; each family's ``ModelArch``."""

from __future__ import annotations

import pytest
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2VLConfig, Qwen3Config

from atlas_vlm import LLM
from atlas_vlm.models import ModelArch
from atlas_vlm.models.registry import (FAMILIES, SUPPORTED_ARCHITECTURES, UnsupportedModelError, model_class,
                                       resolve_family)

pytestmark = pytest.mark.text


def test_every_family_line_resolves_and_imports():
    names = [f.name for f in FAMILIES]
    assert len(names) == len(set(names))
    for fam in FAMILIES:
        for a in fam.architectures:
            assert SUPPORTED_ARCHITECTURES[a] == fam.name
        assert callable(model_class(fam))
    for arch in ("Qwen2VLForConditionalGeneration", "Qwen3ForCausalLM", "Qwen2_5_VLForConditionalGeneration"):
        assert arch in SUPPORTED_ARCHITECTURES


def test_model_type_fallback_only_without_architectures():
    assert resolve_family(Qwen3Config()).name == "qwen3"  # no architectures field
    with pytest.raises(UnsupportedModelError, match="Qwen3ForSequenceClassification"):
        resolve_family(Qwen3Config(architectures=["Qwen3ForSequenceClassification"]))


def test_unsupported_checkpoint_refused_at_load_with_the_list(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as e:
        LLM(str(tmp_path))
    for arch in ["GPT2LMHeadModel", *SUPPORTED_ARCHITECTURES]:
        assert arch in str(e.value)


def test_qwen3_arch_reads_head_dim_and_qk_norm():
    cfg = Qwen3Config(hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      architectures=["Qwen3ForCausalLM"])
    arch = ModelArch.from_hf_config(cfg)
    assert (arch.family, arch.head_dim, arch.qk_norm, arch.qkv_bias, arch.o_bias) == ("qwen3", 128, True, False, False)


def test_qwen2_vl_arch_reads_the_text_config():
    cfg = Qwen2VLConfig(text_config=dict(hidden_size=1536, num_attention_heads=12, num_key_value_heads=2,
                                         num_hidden_layers=28, rope_scaling={"type": "mrope",
                                                                             "mrope_section": [16, 24, 24]}),
                        architectures=["Qwen2VLForConditionalGeneration"])
    arch = ModelArch.from_hf_config(cfg)
    assert (arch.family, arch.num_layers, arch.head_dim, arch.num_kv_heads) == ("qwen2_vl", 28, 128, 2)
    assert arch.mrope_section == (16, 24, 24) and arch.qkv_bias and not arch.qk_norm
