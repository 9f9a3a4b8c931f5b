"""Inputs of a VLM engine (tiny random Qwen2.5-VL): unknown content types refused instead
of dropped (issue 7, example 9); ``MultiModalOptions`` or a dict; image download limits set
through ``LLM`` / ``EngineConfig`` (example 11); assistant prefill with an image."""

from __future__ import annotations

import pytest

from helpers import CPU_FP32, IMAGES, slow_http_server
from atlas_vlm import LLM, EngineConfig, MultiModalOptions, SamplingParams
from mm_token_pipeline import ImageInputError

pytestmark = pytest.mark.vlm

PIX = 28 * 28


@pytest.fixture(scope="module")
def server():
    with slow_http_server() as s:
        yield s


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen2_5_vl"][0]), max_model_len=1024, num_kvcache_blocks=128,
               allow_http_images=True, http_image_timeout_s=1.0, http_image_max_bytes=50_000,
               allowed_media_domains=["127.0.0.1"], **CPU_FP32)  # the test server is on loopback


def user(*items):
    return [{"role": "user", "content": list(items)}]


IMAGE = {"type": "image", "image": str(IMAGES / "chelsea.png")}
TEXT = {"type": "text", "text": "What is this?"}


@pytest.mark.parametrize(("item", "name"), [
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "input_audio"),
    ({"type": "audio_url", "audio_url": {"url": "clip.wav"}}, "audio_url"),
    ({"type": "file", "file": {"file_id": "f"}}, "file"),
])
def test_unknown_content_type_refused_not_dropped(llm, item, name):
    with pytest.raises(ValueError, match=f"content type '{name}' is not supported"):
        llm.chat(user(IMAGE, item, TEXT), SamplingParams(max_tokens=1), use_tqdm=False)
    assert not llm.engine.requests


def test_mm_options_dataclass_or_dict(llm):
    conv = user(IMAGE, TEXT)
    typed = llm.engine.process_prompt({"messages": conv, "mm_options": MultiModalOptions(max_pixels=64 * PIX)})
    plain = llm.engine.process_prompt({"messages": conv, "mm_options": {"max_pixels": 64 * PIX}})
    default = llm.engine.process_prompt({"messages": conv})
    assert typed.prompt_token_ids == plain.prompt_token_ids
    assert typed.images[0].num_tokens == plain.images[0].num_tokens <= 64 < default.images[0].num_tokens == 176
    with pytest.raises(ValueError, match=r"image 0: unknown option"):
        MultiModalOptions.from_value({"max_pixelz": 1}, where="image 0")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['resized_width'\] in a 'image' item"):
        llm.engine.process_prompt({"messages": user({**IMAGE, "resized_width": 56}, TEXT)})


def test_prefill_with_an_image(llm):
    conv = user(IMAGE, TEXT) + [{"role": "assistant", "content": "It is a"}]
    (out,) = llm.chat(conv, SamplingParams(temperature=0, max_tokens=3), add_generation_prompt=False,
                      continue_final_message=True, mm_options={"max_pixels": 64 * PIX}, use_tqdm=False)
    prefill = llm.tokenizer("It is a", add_special_tokens=False)["input_ids"]
    assert out.prompt_token_ids[-len(prefill):] == prefill and len(out.token_ids) == 3


def test_download_limits_set_through_llm(llm, server):
    base, srv = server
    with pytest.raises(ImageInputError, match=r"overall deadline of 1\.0 s"):
        llm.chat(user({"type": "image_url", "image_url": {"url": base + "/drip-body"}}, TEXT),
                 SamplingParams(max_tokens=1), use_tqdm=False)
    assert srv.drips.get(timeout=30)[2] is False
    with pytest.raises(ImageInputError, match="over max_http_bytes=50000"):  # chelsea.png is larger
        llm.chat(user({"type": "image", "image": base + "/chelsea.png"}, TEXT), SamplingParams(max_tokens=1),
                 use_tqdm=False)
    small = llm.engine.process_prompt({"messages": user({"type": "image", "image": base + "/half_transparent.png"})})
    local = llm.engine.process_prompt({"messages": user({"type": "image", "image": str(IMAGES / "half_transparent.png")})})
    assert small.prompt_token_ids == local.prompt_token_ids
    assert not llm.engine.requests


@pytest.mark.parametrize(("kwargs", "cause"), [
    ({"http_image_timeout_s": 0}, "http_image_timeout_s must be > 0"),
    ({"http_image_max_bytes": 0}, "http_image_max_bytes must be an int >= 1"),
])
def test_download_limits_validated(kwargs, cause):
    with pytest.raises(ValueError, match=cause):
        EngineConfig(model="x", **kwargs)
