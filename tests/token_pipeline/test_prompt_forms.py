"""Chat forms on the Qwen2.5-VL path: ``build_prompt_ids`` equals the HF
``Qwen2_5_VLProcessor`` (Qwen tokenizer + ``Qwen2VLImageProcessor`` + the Qwen2.5-VL chat
template) for string / list / ``None`` content, system messages, ``add_generation_prompt``,
``continue_final_message``, a ``chat_template`` override and ``chat_template_kwargs``; and
message validation (unknown content types, keys and roles named)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLImageProcessor

from helpers import IMAGES
from atlas_vlm.models.qwen2_vl.tokenizer_files import qwen_tokenizer_dir
from mm_token_pipeline import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, load_image
from mm_token_pipeline.messages import check_messages, to_string_content
from atlas_vlm.models.qwen2_vl.image_processor import preprocess_image
from atlas_vlm.models.qwen2_vl.prompt_ids import QWEN2_5_VL_CHAT_TEMPLATE, build_prompt_ids

pytestmark = pytest.mark.vlm

IMAGE_PAD = 151655
IMG = {"type": "image", "image": str(IMAGES / "chelsea.png")}
OTHER_SYSTEM = QWEN2_5_VL_CHAT_TEMPLATE.replace("You are a helpful assistant.", "You look at pictures.")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


@pytest.fixture(scope="module")
def processor(tokenizer):
    from transformers import Qwen2VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(min_pixels=DEFAULT_MIN_PIXELS, max_pixels=DEFAULT_MAX_PIXELS)
    return Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                               video_processor=Qwen2VLVideoProcessor(), chat_template=QWEN2_5_VL_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def chelsea():
    image = load_image(IMAGES / "chelsea.png")
    return image, preprocess_image(image)


# name -> (messages, our keyword arguments); HF gets the same messages with None content as []
FORMS = {
    "list": ([{"role": "user", "content": [IMG, {"type": "text", "text": "Describe this image."}]}], {}),
    "system_string": ([{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": [{"type": "text", "text": "Look:"}, IMG,
                                                    {"type": "text", "text": "What is it?"}]}], {}),
    "string_then_image": ([{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"},
                           {"role": "user", "content": [IMG, {"type": "text", "text": "And this?"}]}], {}),
    "none_content": ([{"role": "user", "content": [IMG]}, {"role": "assistant", "content": None},
                      {"role": "user", "content": "Well?"}], {}),
    "no_generation_prompt": ([{"role": "user", "content": [IMG, {"type": "text", "text": "Hi"}]}],
                             {"add_generation_prompt": False}),
    "continue_final": ([{"role": "user", "content": [IMG, {"type": "text", "text": "What animal is this?"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": "This animal is a"}]}],
                       {"add_generation_prompt": False, "continue_final_message": True}),
    "continue_final_string": ([{"role": "user", "content": [IMG, {"type": "text", "text": "Name it."}]},
                               {"role": "assistant", "content": "It is called"}],
                              {"add_generation_prompt": False, "continue_final_message": True}),
    "template_override": ([{"role": "user", "content": [IMG, {"type": "text", "text": "Hi"}]}],
                          {"chat_template": OTHER_SYSTEM}),
    "template_kwargs": ([{"role": "user", "content": [IMG, {"type": "text", "text": "Hi"}]}],
                        {"chat_template_kwargs": {"add_vision_id": True}}),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_prompt_ids_equal_hf_processor(tokenizer, processor, chelsea, form):
    messages, kwargs = FORMS[form]
    image, processed = chelsea
    ids = build_prompt_ids(tokenizer, messages, [processed], **kwargs)
    hf_messages = [{**m, "content": [] if m["content"] is None else m["content"]} for m in messages]
    hf_kwargs = {"add_generation_prompt": kwargs.get("add_generation_prompt", True),
                 "continue_final_message": kwargs.get("continue_final_message", False),
                 **kwargs.get("chat_template_kwargs", {})}
    if "chat_template" in kwargs:
        hf_kwargs["chat_template"] = kwargs["chat_template"]
    text = processor.apply_chat_template(hf_messages, tokenize=False, **hf_kwargs)
    ref = processor(text=[text], images=[image])["input_ids"][0]
    assert ids == list(ref)
    assert ids.count(IMAGE_PAD) == processed.num_tokens == 176
    if form.startswith("continue_final"):
        assert not tokenizer.decode(ids).endswith("<|im_end|>\n")
        assert tokenizer.decode(ids).endswith(("This animal is a", "It is called"))
    if form == "template_kwargs":
        assert "Picture 1: <|vision_start|>" in tokenizer.decode(ids)


def test_both_generation_flags_refused(tokenizer, chelsea):
    messages, _ = FORMS["continue_final"]
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt are not compatible"):
        build_prompt_ids(tokenizer, messages, [chelsea[1]], add_generation_prompt=True, continue_final_message=True)


@pytest.mark.parametrize(("messages", "cause"), [
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "'input_audio' is not supported"),
    ([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "v.mp4", "detail": "low"}}]}],
     r"video_url: unknown key\(s\) \['detail'\]; allowed: \['url'\]"),
    ([{"role": "user", "content": [{"type": "video", "video": "v.mp4", "fsp": 2}]}],
     r"unknown key\(s\) \['fsp'\] in a 'video' item"),
    ([{"role": "user", "content": [{"foo": 1}]}], "content type None is not supported"),
    ([{"role": "user", "content": [{"type": "image", "image": "a.png", "resized_height": 56}]}],
     r"unknown key\(s\) \['resized_height'\] in a 'image' item"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png", "detail": "high"}}]}],
     "detail='high' is not supported"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}], "needs a str 'text'"),
    ([{"content": "Hi"}], "role None is not one of"),
    ([], "non-empty list"),
])
def test_messages_refused_with_the_cause_named(messages, cause):
    with pytest.raises((ValueError, TypeError), match=cause):
        check_messages(messages)


def test_string_content_format_joins_text_with_newline():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]},
                {"role": "assistant", "content": None}, {"role": "tool", "content": "c"}]
    check_messages(messages)
    assert to_string_content(messages) == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""},
                                           {"role": "tool", "content": "c"}]
    with pytest.raises(ValueError, match="text-only"):
        to_string_content([{"role": "user", "content": [IMG]}])
