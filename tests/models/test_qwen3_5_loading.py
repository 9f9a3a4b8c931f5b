"""Qwen3.5 through our loader: the checkpoint's mtp.* tensors kept on the model, the state
spec read from the config, quantized loading refused by name, the registry's family."""

from __future__ import annotations

import pytest
import torch

from atlas_vlm.loader import load_model
from atlas_vlm.models import ModelArch
from atlas_vlm.quantization import UnsupportedQuantizationError
from qwen3_5_helpers import build_tiny_qwen3_5, tiny_config

pytestmark = pytest.mark.text


@pytest.fixture(scope="module")
def folder_with_mtp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_mtp")
    mtp = {"fc.weight": torch.randn(64, 128), "layers.0.input_layernorm.weight": torch.randn(64)}
    build_tiny_qwen3_5(folder, seed=3, mtp=mtp)
    return folder, mtp


def test_mtp_weights_are_kept(folder_with_mtp):
    folder, mtp = folder_with_mtp
    model = load_model(folder).model
    assert sorted(model.mtp_state_dict) == sorted(mtp)
    for name, tensor in mtp.items():
        assert torch.equal(model.mtp_state_dict[name], tensor)


def test_state_spec_and_kv_layers_follow_the_config(folder_with_mtp):
    model = load_model(folder_with_mtp[0]).model
    text = tiny_config().text_config
    spec = model.state_spec()
    assert model.num_kv_layers == text.layer_types.count("full_attention") == 1
    assert spec.num_layers == text.layer_types.count("linear_attention") == 3
    key_dim = text.linear_num_key_heads * text.linear_key_head_dim
    assert spec.conv_dim == 2 * key_dim + text.linear_num_value_heads * text.linear_value_head_dim
    assert spec.conv_shape == (spec.conv_dim, text.linear_conv_kernel_dim - 1)
    assert spec.recurrent_shape == (text.linear_num_value_heads, text.linear_key_head_dim,
                                    text.linear_value_head_dim)
    assert model.qkv_sizes == [2 * 4 * 32, 2 * 32, 2 * 32]  # q_proj = query + gate


def test_arch_reads_interleaved_partial_mrope():
    arch = ModelArch.from_hf_config(tiny_config())
    assert (arch.family, arch.mrope_section, arch.mrope_interleaved, arch.head_dim) == ("qwen3_5", (2, 1, 1), True, 32)


def test_quantized_loading_is_refused_by_name(folder_with_mtp):
    with pytest.raises(UnsupportedQuantizationError, match="qwen3_5"):
        load_model(folder_with_mtp[0], quantization="int8")


def test_layer_types_must_name_known_layers():
    from atlas_vlm.models.qwen3_5.model import Qwen3_5ForCausalLM

    config = tiny_config()
    config.text_config.layer_types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer_types"):
        Qwen3_5ForCausalLM(ModelArch.from_hf_config(config), config.text_config)


@pytest.mark.parametrize("which", ["tiny", "released_default"])
def test_text_param_count_equals_hf(which):
    """``param_count.text_params`` == HF's decoder + LM head, built on the meta device."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from atlas_vlm.models.param_count import text_params

    config = tiny_config() if which == "tiny" else Qwen3_5Config()
    with torch.device("meta"):
        hf = Qwen3_5ForConditionalGeneration(config)
    decoder = hf.model.language_model
    expected = sum(p.numel() for p in decoder.parameters())
    if not config.tie_word_embeddings:
        expected += hf.lm_head.weight.numel()
    assert text_params(config) == expected
