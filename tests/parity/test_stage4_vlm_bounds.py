"""Stage 4 (visual tokens on the paged KV cache): MAC-V2 (visual token bounds, block
accounting), cases C16 (over max_model_len), C08 (literal special strings), C15 (bad image
files) and the image input forms / per-item options, at the engine level. MAC-V1 and MAC-V3
parity with HF are in test_stage4_vlm_parity.py.

Every engine call here goes through ``LLM.chat``, recorded by ``_vlm_helpers.record``.
"""

from __future__ import annotations

import base64
import io

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from helpers import (IMAGE_PAD, IMAGES, MAX_MODEL_LEN, MEDIUM, PIX, SMALL, VISION_START, assert_matches_hf, chat,
                          conv, greedy)
from atlas_vlm.engine import RequestTooLongError
from mm_token_pipeline import ImageInputError

pytestmark = pytest.mark.vlm


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def hf(vl):
    return vl[1]


# ---- MAC-V2 bounds ---------------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens_per_image", [4, 16, 63, 64, 100, 256, 1000])
def test_visual_tokens_never_exceed_max_pixels(llm, max_tokens_per_image):
    max_pixels = max_tokens_per_image * PIX + 500  # not a multiple of 784 on purpose
    files = ["chelsea.png", "camera.png", "logo.png", "coffee.png", "rocket.jpg", "grace_hopper.jpg",
             "no_time_for_that_tiny.gif", "strip_31x639.png", "aspect_200.png", "exif_orient6.jpg"]
    for name in files:
        c = conv(IMAGES / name, text="hi")
        p = llm.engine.process_prompt({"messages": c, "mm_options": {"max_pixels": max_pixels,
                                                                     "min_pixels": min(4 * PIX, max_pixels)}})
        (img,) = p.images
        assert 1 <= img.num_tokens <= max_pixels // PIX, (name, img.grid_thw)
        assert img.resized_hw[0] * img.resized_hw[1] <= max_pixels
        assert sum(t == IMAGE_PAD for t in p.prompt_token_ids) == img.num_tokens


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.integers(1, 1600), height=st.integers(1, 1600), max_tokens=st.integers(4, 600),
       extra=st.integers(0, PIX - 1))
def test_visual_tokens_bound_random_sizes(llm, width, height, max_tokens, extra):
    max_pixels = max_tokens * PIX + extra
    image = Image.new("RGB", (width, height), (width % 256, height % 256, 7))
    c = conv(image, text="size?")
    request = {"messages": c, "mm_options": {"max_pixels": max_pixels}}
    if max(width, height) / min(width, height) > 200:
        with pytest.raises(ImageInputError, match="aspect ratio"):
            llm.engine.process_prompt(request)
        return
    p = llm.engine.process_prompt(request)
    (img,) = p.images
    assert 1 <= img.num_tokens <= max_pixels // PIX
    assert sum(t == IMAGE_PAD for t in p.prompt_token_ids) == img.num_tokens


def _too_long_image():
    return Image.new("RGB", (1400, 1400), (200, 30, 30))  # 2500 tokens at max_pixels 2600*784


def test_c16_image_tokens_over_max_model_len_refused_before_allocation(llm):
    big = conv({"type": "image", "image": _too_long_image(), "max_pixels": 2600 * PIX}, text="What is this?")
    p = llm.engine.process_prompt({"messages": big})
    assert len(p.prompt_token_ids) > MAX_MODEL_LEN  # image tokens push it over
    bm = llm.engine.block_manager
    free = bm.num_free_blocks
    runs = llm.engine.runner.num_encoder_runs
    with pytest.raises(RequestTooLongError, match="max_model_len"):
        llm.chat(big, greedy(4), use_tqdm=False)
    assert bm.num_free_blocks == free == bm.num_blocks
    assert llm.engine.runner.num_encoder_runs == runs  # the vision tower never ran
    assert not llm.engine.requests and not llm.engine.scheduler.waiting and not llm.engine.scheduler.running


def test_c16_prompt_plus_max_tokens_over_max_model_len_refused(llm):
    c = conv({"type": "image", "image": _too_long_image(), "max_pixels": 2000 * PIX}, text="What is this?")
    n = len(llm.engine.process_prompt({"messages": c}).prompt_token_ids)
    assert n < MAX_MODEL_LEN
    bm = llm.engine.block_manager
    with pytest.raises(RequestTooLongError):
        llm.chat(c, greedy(MAX_MODEL_LEN - n + 1), use_tqdm=False)
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests


def test_c16_in_a_list_call_is_an_error_output_others_complete(llm):
    good = conv(IMAGES / "coffee.png", text="What is in the cup?")
    big = conv({"type": "image", "image": _too_long_image(), "max_pixels": 2600 * PIX}, text="What is this?")
    (alone,), _ = chat(llm, [good], 8, SMALL)
    outs, rec = chat(llm, [good, big, good], 8, SMALL)
    assert [o.finish_reason for o in outs][1] == "error"
    assert "max_model_len" in outs[1].error and not outs[1].token_ids
    for o in (outs[0], outs[2]):
        assert o.finish_reason in ("length", "stop") and o.token_ids == alone.token_ids
    assert outs[1].request_id not in rec.by_request


# ---- C08 --------------------------------------------------------------------------------------------
def test_c08_literal_special_strings_in_user_text(llm, hf):
    c = conv(IMAGES / "chelsea.png", text="What do '<|image_pad|>' and '<|vision_start|>' mean here?")
    p = llm.engine.process_prompt({"messages": c})  # default max_pixels
    ids = p.prompt_token_ids
    assert sum(t == IMAGE_PAD for t in ids) == 176
    pads = [i for i, t in enumerate(ids) if t == IMAGE_PAD]
    assert pads == list(range(pads[0], pads[0] + 176))  # exactly one run
    assert sum(t == VISION_START for t in ids) == 1
    assert "<|image_pad|>" in llm.tokenizer.decode(ids[pads[-1] + 1:])  # still there, as text
    (out,), rec = chat(llm, [c], 6)
    assert len(out.token_ids) >= 1
    assert_matches_hf(llm, hf, c, out, rec, 6)


# ---- C15 --------------------------------------------------------------------------------------------
def test_c15_bad_files_in_a_batch_beside_a_good_request(llm):
    causes = {"zero_bytes.png": "empty", "truncated.jpg": "truncated", "not_an_image.png": "not an image",
              "bomb_40000x40000.png": "bomb"}
    good = conv(IMAGES / "chelsea.png", text="Describe.")
    (alone,), _ = chat(llm, [good], 8, SMALL)
    convs = [conv(IMAGES / name, text="Describe.") for name in causes]
    convs.insert(2, good)
    outs, rec = chat(llm, convs, 8, SMALL)
    bad = outs[:2] + outs[3:]
    for name, out in zip(causes, bad):
        assert out.finish_reason == "error" and not out.token_ids
        assert name in out.error and causes[name] in out.error, out.error
        assert out.request_id not in rec.by_request
    assert outs[2].finish_reason in ("length", "stop")
    assert outs[2].token_ids == alone.token_ids


def test_c15_single_bad_file_raises_and_leaks_nothing(llm):
    bm = llm.engine.block_manager
    with pytest.raises(ImageInputError, match="truncated.jpg"):
        llm.chat(conv(IMAGES / "truncated.jpg", text="x"), greedy(4), use_tqdm=False)
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests


# ---- input forms and per-item options ----------------------------------------------------------------
def test_all_image_input_forms_give_the_same_request(llm):
    path = IMAGES / "chelsea.png"
    raw = path.read_bytes()
    forms = {
        "path": {"type": "image", "image": str(path)},
        "pathlib": {"type": "image", "image": path},
        "file_uri": {"type": "image", "image": path.resolve().as_uri()},
        "data_uri": {"type": "image", "image": "data:image/png;base64," + base64.b64encode(raw).decode()},
        "bytes": {"type": "image", "image": raw},
        "pil": {"type": "image", "image": Image.open(io.BytesIO(raw))},
        "image_url": {"type": "image_url", "image_url": {"url": str(path)}},
        "image_url_data": {"type": "image_url",
                           "image_url": {"url": "data:image/png;base64," + base64.b64encode(raw).decode()}},
    }
    convs = {name: conv(item, text="Describe.") for name, item in forms.items()}
    ref = llm.engine.process_prompt({"messages": convs["path"], "mm_options": SMALL})
    for name, c in convs.items():
        p = llm.engine.process_prompt({"messages": c, "mm_options": SMALL})
        assert p.prompt_token_ids == ref.prompt_token_ids, name
        assert p.images[0].grid_thw == ref.images[0].grid_thw, name
        assert torch.equal(p.images[0].pixel_values, ref.images[0].pixel_values), name
        assert p.images[0].content_hash == ref.images[0].content_hash, name
    outs, _ = chat(llm, list(convs.values()), 4, SMALL)
    for name, out in zip(convs, outs):
        assert out.finish_reason in ("length", "stop"), (name, out.error)
        assert out.token_ids == outs[0].token_ids, name


def test_per_item_max_pixels_overrides_mm_options(llm):
    path = str(IMAGES / "coffee.png")
    override = conv({"type": "image", "image": path, "max_pixels": 16 * PIX},
                    {"type": "image", "image": str(IMAGES / "rocket.jpg")}, text="Two.")
    p = llm.engine.process_prompt({"messages": override, "mm_options": MEDIUM})
    assert p.images[0].num_tokens <= 16 < p.images[1].num_tokens <= 256
    plain = conv(path, str(IMAGES / "rocket.jpg"), text="Two.")
    only_first = llm.engine.process_prompt({"messages": plain, "mm_options": {"max_pixels": 16 * PIX}})
    assert p.images[0].grid_thw == only_first.images[0].grid_thw
    assert torch.equal(p.images[0].pixel_values, only_first.images[0].pixel_values)
    default = llm.engine.process_prompt({"messages": plain, "mm_options": MEDIUM})
    assert p.images[1].grid_thw == default.images[1].grid_thw
    # per-item min_pixels too
    up = conv({"type": "image", "image": str(IMAGES / "no_time_for_that_tiny.gif"), "min_pixels": 32 * PIX},
              text="Tiny.")
    assert llm.engine.process_prompt({"messages": up, "mm_options": SMALL}).images[0].num_tokens >= 32
    # and through chat: the override changes the request (and the tokens match the direct form)
    (a, b), _ = chat(llm, [override, override], 4, MEDIUM)
    assert a.prompt_token_ids == p.prompt_token_ids and a.token_ids == b.token_ids


def test_untyped_image_item_is_an_image(llm):
    """``{"image": src}`` without ``"type"`` is an image for the chat template, so it must be
    one for image loading too: same ids, pixels and tokens as the typed item."""
    path = str(IMAGES / "chelsea.png")
    typed = llm.engine.process_prompt({"messages": conv({"type": "image", "image": path}, text="Hi"), "mm_options": SMALL})
    untyped = llm.engine.process_prompt({"messages": conv({"image": path}, text="Hi"), "mm_options": SMALL})
    assert untyped.prompt_token_ids == typed.prompt_token_ids
    assert [img.content_hash for img in untyped.images] == [img.content_hash for img in typed.images]
    assert sum(t == IMAGE_PAD for t in untyped.prompt_token_ids) == typed.images[0].num_tokens
