"""The checkpoint's own image-processor settings (``atlas_vlm.models.processor_settings.image_processor_settings``)
are the engine's default bounds, with engine, request and item options over them in that
order; the server's bounds bind (``limit_request_pixels``); and a Qwen3-VL folder with the
released ``preprocessor_config.json`` gives transformers' own token counts for odd sizes with
no options passed."""

from __future__ import annotations

import json
import shutil

import pytest
from PIL import Image

import mm_token_pipeline as mtp
from atlas_vlm.models.processor_settings import image_processor_settings
from atlas_vlm import LLM, EngineConfig
from atlas_vlm.engine.chat_input import ChatInput
from helpers import conv
from tiny_vlms import build_tiny_qwen3_vl
from atlas_vlm.models.qwen2_vl.image_processor import preprocess_image

pytestmark = pytest.mark.vlm

#: Qwen/Qwen3-VL-*-Instruct preprocessor_config.json, as released
QWEN3_VL_RELEASED = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16,
                     "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                     "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessorFast",
                     "processor_class": "Qwen3VLProcessor"}


def gradient(width: int, height: int) -> Image.Image:
    img = Image.new("RGB", (width, height))
    img.putdata([((x * 7) % 256, (y * 5) % 256, (x + y) % 256) for y in range(height) for x in range(width)]
                if width * height <= 1 << 20 else [(90, 140, 200)] * (width * height))
    return img


@pytest.fixture(scope="module")
def qwen3_vl_released(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_vl_released")
    build_tiny_qwen3_vl(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(QWEN3_VL_RELEASED))
    return folder


def test_settings_come_from_the_folder(qwen3_vl_released):
    from transformers import AutoConfig

    s = image_processor_settings(qwen3_vl_released, AutoConfig.from_pretrained(qwen3_vl_released))
    assert (s.min_pixels, s.max_pixels, s.patch_size, s.merge_size, s.temporal_patch_size) == (65536, 16777216, 16, 2, 2)
    assert s.image_mean == s.image_std == (0.5, 0.5, 0.5)
    assert s.source == str(qwen3_vl_released / "preprocessor_config.json")


@pytest.mark.parametrize("width, height, hf_tokens", [(1, 1, 64), (31, 639, 74), (2000, 30, None), (4000, 4000, 15625)])
def test_released_qwen3_vl_folder_gives_transformers_token_counts(qwen3_vl_released, width, height, hf_tokens):
    """No options passed: the engine's visual tokens equal transformers' processor's
    (``AutoImageProcessor`` on the same folder, told the image is channels-last)."""
    from transformers import AutoConfig, AutoImageProcessor

    image = gradient(width, height)
    hf = AutoImageProcessor.from_pretrained(qwen3_vl_released)
    grid = hf(images=[image], return_tensors="pt", input_data_format="channels_last")["image_grid_thw"][0]
    expected = int(grid.prod()) // 4
    if hf_tokens is not None:
        assert expected == hf_tokens  # the figures the issue measured with transformers
    hf_config = AutoConfig.from_pretrained(qwen3_vl_released)
    settings = image_processor_settings(qwen3_vl_released, hf_config)
    chat = ChatInput(None, EngineConfig(model=str(qwen3_vl_released)), hf_config, settings)
    opts = chat.engine_bounds
    ours = preprocess_image(image, min_pixels=opts.min_pixels, max_pixels=opts.max_pixels,
                                **settings.preprocess_kwargs())
    assert ours.num_tokens == expected
    assert list(ours.grid_thw) == grid.tolist()


def test_engine_uses_the_folder_bounds_end_to_end(qwen3_vl_released):
    llm = LLM(str(qwen3_vl_released), dtype="float32", device="cpu", max_model_len=256, num_kvcache_blocks=32)
    _, images = llm.engine.input_processor.chat.process({"messages": conv(gradient(31, 639), text="hi")})
    assert [im.num_tokens for im in images] == [74]


@pytest.fixture
def qwen25(tiny_models, tmp_path):
    """The tiny Qwen2.5-VL with a preprocessor_config.json in the older layout
    (``min_pixels`` / ``max_pixels`` at top level), as Qwen2.5-VL checkpoints ship it."""
    src, _ = tiny_models["qwen2_5_vl"]
    folder = tmp_path / "qwen25"
    shutil.copytree(src, folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": 8 * 784, "max_pixels": 100 * 784, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}))
    return folder


def _tokens(folder, messages, mm_options=None, **engine):
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(folder)
    chat = ChatInput(None, EngineConfig(model=str(folder), **engine), hf_config,
                     image_processor_settings(folder, hf_config))
    media = chat.media.media({"messages": messages, "mm_options": mtp.MultiModalOptions.from_value(mm_options)})
    pairs = [(opts, pil) for _, _, opts, pil in media]  # (modality, index, options, loaded image)
    return [preprocess_image(pil, min_pixels=o.min_pixels, max_pixels=o.max_pixels).num_tokens for o, pil in pairs]


def test_checkpoint_then_engine_then_request_then_item(qwen25):
    big = gradient(600, 600)  # 360,000 pixels: every bound below binds
    assert _tokens(qwen25, conv(big)) == [100]  # the checkpoint's max_pixels
    assert _tokens(qwen25, conv(big), max_pixels=200 * 784) == [196]  # the engine's (14 x 14 merged patches)
    assert _tokens(qwen25, conv(big), {"max_pixels": 50 * 784}, max_pixels=200 * 784) == [49]  # the request's
    item = [{"role": "user", "content": [{"type": "image", "image": big, "max_pixels": 20 * 784},
                                         {"type": "text", "text": "hi"}]}]
    assert _tokens(qwen25, item, {"max_pixels": 50 * 784}, max_pixels=200 * 784) == [16]  # the item's


def test_server_bounds_bind(qwen25):
    big = gradient(600, 600)
    assert _tokens(qwen25, conv(big), {"max_pixels": 50 * 784}, limit_request_pixels=True) == [49]  # lower: fine
    with pytest.raises(ValueError, match=r"image 0: max_pixels 313600 is above this server's max_pixels 78400"):
        _tokens(qwen25, conv(big), {"max_pixels": 400 * 784}, limit_request_pixels=True)
    item = [{"role": "user", "content": [{"type": "image", "image": big, "max_pixels": 20_000_000}]}]
    with pytest.raises(ValueError, match="a request may lower the image bounds, not raise them"):
        _tokens(qwen25, item, limit_request_pixels=True)
    with pytest.raises(ValueError, match=r"min_pixels \(20000000\) must be <= max_pixels \(78400\)"):
        _tokens(qwen25, conv(big), {"min_pixels": 20_000_000}, limit_request_pixels=True)
    assert _tokens(qwen25, conv(big), {"max_pixels": 400 * 784}) == [400]  # the library may raise them


def test_engine_bounds_that_contradict_the_checkpoint_name_the_flags(qwen25):
    with pytest.raises(ValueError, match=r"max_pixels 1000 \(set by max_pixels / --max-pixels\) is below min_pixels "
                                         r"6272 \(from .*preprocessor_config.json\)"):
        _tokens(qwen25, conv(gradient(50, 50)), max_pixels=1000)
    assert _tokens(qwen25, conv(gradient(50, 50)), max_pixels=1000, min_pixels=784) == [1]


def test_a_processor_that_disagrees_with_the_tower_is_refused(qwen25):
    from transformers import AutoConfig

    cfg = json.loads((qwen25 / "preprocessor_config.json").read_text())
    (qwen25 / "preprocessor_config.json").write_text(json.dumps({**cfg, "patch_size": 16}))
    with pytest.raises(ValueError, match="patch_size 16 disagrees with the vision tower's patch_size 14"):
        image_processor_settings(qwen25, AutoConfig.from_pretrained(qwen25))


def test_no_preprocessor_config_means_the_released_defaults(tiny_models):
    from transformers import AutoConfig

    folder, _ = tiny_models["qwen2_5_vl"]
    s = image_processor_settings(folder, AutoConfig.from_pretrained(folder))
    assert (s.min_pixels, s.max_pixels) == (3136, 12845056) and "no preprocessor_config.json" in s.source
    assert image_processor_settings(folder, AutoConfig.from_pretrained(tiny_models["qwen2"][0])) is None
