"""The real Qwen3-VL-4B-Instruct and SmolVLM2-2.2B-Instruct geometries (their public
``config.json``, no weights): every tensor of HF's model maps, through our loader's name
rules, onto a parameter of our decoder or of our vision wrapper with the same shape, and
nothing of ours is left without a source. Built on the meta device (no memory)."""

from __future__ import annotations

import pytest
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForImageTextToText

from helpers import REPO
from atlas_vlm.loader import _our_name
from atlas_vlm.models import ModelArch
from atlas_vlm.models.registry import model_class, resolve_family

pytestmark = pytest.mark.vlm

CONFIGS = REPO / "tests" / "data" / "configs"


def _ours(config):
    from atlas_vlm.models.qwen3_vl.vision import Qwen3VLVisionEncoder
    from atlas_vlm.models.smolvlm.vision import SmolVLMVisionEncoder

    arch = ModelArch.from_hf_config(config)
    family = resolve_family(config)
    assert family.multimodal and family.nested_text_config
    decoder = model_class(family)(arch, config.text_config)
    if arch.family == "qwen3_vl":
        vision = Qwen3VLVisionEncoder(config.vision_config).model
    else:
        vision = SmolVLMVisionEncoder(config)
    return arch, decoder, vision


@pytest.mark.parametrize("name, family", [("Qwen3-VL-4B-Instruct", "qwen3_vl"), ("SmolVLM2-2.2B-Instruct", "smolvlm")])
def test_every_hf_tensor_has_a_place_of_the_same_shape(name, family):
    config = AutoConfig.from_pretrained(CONFIGS / name)
    with init_empty_weights():  # parameters on the meta device, plain tensors (RoPE tables) as usual
        hf = AutoModelForImageTextToText.from_config(config)
        arch, decoder, vision = _ours(config)
    assert arch.family == family
    ours = {k: v.shape for k, v in decoder.named_parameters()}
    vis = {k: v.shape for k, v in vision.state_dict().items()}
    filled: dict[str, int] = {}
    for hf_name, tensor in hf.state_dict().items():
        kind, our_name, shard = _our_name(hf_name)
        if kind == "visual":
            assert vis.pop(our_name) == tensor.shape, hf_name
            continue
        if arch.tie_word_embeddings and our_name == "lm_head.weight":
            continue
        assert our_name in ours, hf_name
        rows = tensor.shape[0]
        filled[our_name] = filled.get(our_name, 0) + rows
        assert ours[our_name][1:] == tensor.shape[1:], hf_name
        if shard is None:
            assert ours[our_name] == tensor.shape, hf_name
    assert not vis, f"vision tensors without a source: {sorted(vis)[:5]}"
    for our_name, shape in ours.items():
        if arch.tie_word_embeddings and our_name == "lm_head.weight":
            continue
        assert filled.get(our_name) == shape[0], our_name  # fused rows all filled


def test_qwen3_vl_4b_arch_fields():
    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(CONFIGS / "Qwen3-VL-4B-Instruct"))
    assert (arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.hidden_size) == (128, 32, 8, 2560)
    assert arch.mrope_section == (24, 20, 20) and arch.mrope_interleaved
    assert not arch.qkv_bias and not arch.o_bias and arch.tie_word_embeddings


def test_smolvlm2_arch_fields():
    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(CONFIGS / "SmolVLM2-2.2B-Instruct"))
    assert (arch.head_dim, arch.num_heads, arch.vocab_size, arch.hidden_size) == (64, 32, 49280, 2048)
    assert arch.mrope_section is None and not arch.qkv_bias and not arch.tie_word_embeddings
