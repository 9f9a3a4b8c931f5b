"""Tests of mm_token_pipeline prompt building with the real Qwen2.5 tokenizer.

Case C08 of /work/shared/cases/cases.json (user text never becomes special token ids),
placeholder expansion, image extraction from messages, and the chat template choice.
"""

from __future__ import annotations


import pytest
from transformers import AutoTokenizer

from helpers import IMAGES
from atlas_vlm.models.qwen2_vl.tokenizer_files import qwen_tokenizer_dir
from mm_token_pipeline import extract_images, load_image
from atlas_vlm.models.qwen2_vl.image_processor import preprocess_image
from atlas_vlm.models.qwen2_vl.prompt_ids import QWEN2_5_VL_CHAT_TEMPLATE, build_prompt_ids, expand_image_pads

pytestmark = pytest.mark.vlm

IMAGE_PAD, VISION_START, VISION_END = 151655, 151652, 151653


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


@pytest.fixture(scope="module")
def chelsea():
    return preprocess_image(load_image(IMAGES / "chelsea.png"))


def runs_of(ids, token):
    return sum(1 for i, t in enumerate(ids) if t == token and (i == 0 or ids[i - 1] != token))


def test_tokenizer_ids(tokenizer):
    assert tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"]) == [
        IMAGE_PAD, VISION_START, VISION_END]
    assert "image_pad" not in (tokenizer.chat_template or "")  # text template: the VL one is used


def test_c08_user_text_never_special(tokenizer, chelsea):
    text = "What is <|image_pad|> here? <|vision_start|><|im_end|>"
    messages = [{"role": "user", "content": [
        {"type": "image", "image": str(IMAGES / "chelsea.png")}, {"type": "text", "text": text}]}]
    assert chelsea.num_tokens == 176
    ids = build_prompt_ids(tokenizer, messages, [chelsea])
    assert ids.count(IMAGE_PAD) == 176
    assert runs_of(ids, IMAGE_PAD) == 1
    assert ids.count(VISION_START) == 1 and ids.count(VISION_END) == 1
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2  # system + user turns only
    assert text in tokenizer.decode(ids)


def test_plain_prompt_equals_whole_template_tokenization(tokenizer, chelsea):
    messages = [{"role": "user", "content": [
        {"type": "image", "image": "x.png"}, {"type": "text", "text": "Describe this image."}]}]
    rendered = tokenizer.apply_chat_template(messages, chat_template=QWEN2_5_VL_CHAT_TEMPLATE,
                                             tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                        "<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n"
                        "<|im_start|>assistant\n")
    whole = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    ids = build_prompt_ids(tokenizer, messages, [chelsea])
    assert ids == expand_image_pads(whole, [176], image_token_id=IMAGE_PAD)


def test_two_images_image_url_form_and_string_content(tokenizer, chelsea):
    gif = preprocess_image(load_image(IMAGES / "no_time_for_that_tiny.gif"))
    messages = [
        {"role": "system", "content": "Be brief. <|image_pad|>"},
        {"role": "user", "content": [
            {"type": "text", "text": "First:"},
            {"type": "image_url", "image_url": {"url": "a.png"}},
            {"type": "text", "text": "then"},
            {"type": "image", "image": "b.gif"}]},
    ]
    assert extract_images(messages) == ["a.png", "b.gif"]
    ids = build_prompt_ids(tokenizer, messages, [chelsea, gif], add_generation_prompt=False)
    assert ids.count(IMAGE_PAD) == 176 + 6 and runs_of(ids, IMAGE_PAD) == 2
    first = ids.index(IMAGE_PAD)
    assert ids[first - 1] == VISION_START and ids[first + 176] == VISION_END
    assert "You are a helpful assistant." not in tokenizer.decode(ids)
    assert not tokenizer.decode(ids).endswith("assistant\n")


def test_image_count_mismatch_and_video_refused(tokenizer, chelsea):
    messages = [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}]
    with pytest.raises(ValueError, match="1 image placeholders but 2 images"):
        build_prompt_ids(tokenizer, messages, [chelsea, chelsea])
    with pytest.raises(ValueError, match="video"):
        build_prompt_ids(tokenizer, [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}], [])


def test_expand_image_pads():
    ids = [1, IMAGE_PAD, 2, IMAGE_PAD, 3]
    assert expand_image_pads(ids, [2, 3], image_token_id=IMAGE_PAD) == [
        1, IMAGE_PAD, IMAGE_PAD, 2, IMAGE_PAD, IMAGE_PAD, IMAGE_PAD, 3]
    assert expand_image_pads([1, 2], [], image_token_id=IMAGE_PAD) == [1, 2]
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        expand_image_pads(ids, [4], image_token_id=IMAGE_PAD)
    with pytest.raises(ValueError, match=">= 1 token"):
        expand_image_pads(ids, [4, 0], image_token_id=IMAGE_PAD)


def test_extract_images_errors_and_text_only():
    assert extract_images([{"role": "user", "content": "hi"}]) == []
    with pytest.raises(ValueError, match="without a source"):
        extract_images([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
