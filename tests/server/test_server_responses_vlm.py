"""``/v1/responses`` with an ``input_image`` on the VLM server (tiny random Qwen2.5-VL): the
same greedy answer and token counts as chat completions with the same image (the same image
path), whole and streamed; a bad image is a 400 naming the cause."""

from __future__ import annotations

import openai
import pytest

from test_server_vlm import PHOTO, data_uri, image_msg

pytestmark = [pytest.mark.server, pytest.mark.vlm]


def _input(url: str, text: str = "Describe this image.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                         {"type": "input_text", "text": text}]}]


def test_input_image_equals_chat_whole_and_streamed(vlm_server):
    client = vlm_server.client()
    url = data_uri(PHOTO)
    chat = client.chat.completions.create(model="tiny-vl", messages=image_msg(url), max_tokens=8, temperature=0)
    resp = client.responses.create(model="tiny-vl", input=_input(url), max_output_tokens=8, temperature=0)
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens > 64  # the image's tokens are in the prompt
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    events = list(client.responses.create(model="tiny-vl", input=_input(url), max_output_tokens=8, temperature=0,
                                          stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == resp.output_text
    assert events[-1].response.usage.input_tokens == resp.usage.input_tokens


def test_bad_input_image_is_a_400(vlm_server):
    with pytest.raises(openai.BadRequestError) as e:
        vlm_server.client().responses.create(model="tiny-vl", input=_input("data:image/png;base64,@@@@"),
                                             max_output_tokens=2)
    assert "invalid base64" in e.value.message


def test_input_file_images_equal_input_image(vlm_server):
    """An image as ``input_file``: ``file_data`` (a data URL) and ``file_id`` (uploaded to
    ``/v1/files`` with purpose "vision") give the answer ``input_image`` gives."""
    client = vlm_server.client()
    url = data_uri(PHOTO)
    want = client.responses.create(model="tiny-vl", input=_input(url), max_output_tokens=8, temperature=0)
    uploaded = client.files.create(file=(PHOTO.name, PHOTO.read_bytes()), purpose="vision")
    for part in ({"type": "input_file", "file_data": url, "filename": PHOTO.name},
                 {"type": "input_file", "file_id": uploaded.id}):
        got = client.responses.create(model="tiny-vl", max_output_tokens=8, temperature=0, input=[
            {"role": "user", "content": [part, {"type": "input_text", "text": "Describe this image."}]}])
        assert got.output_text == want.output_text and got.usage.input_tokens == want.usage.input_tokens


def test_input_file_that_is_not_an_image_is_a_400_naming_the_part(vlm_server):
    client = vlm_server.client()
    text_file = client.files.create(file=("notes.txt", b"just text"), purpose="user_data")
    cases = [({"type": "input_file", "file_data": "data:application/pdf;base64,JVBERi0="},
              "input.0.content.0.file_data", "only images"),
             ({"type": "input_file", "file_id": text_file.id}, "input.0.content.0.file_id", "notes.txt"),
             ({"type": "input_file", "file_id": "file-" + "0" * 32}, "input.0.content.0.file_id", "No such File"),
             ({"type": "input_file"}, "input.0.content.0", "exactly one of file_id, file_data, file_url")]
    for part, param, words in cases:
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:
            client.responses.create(model="tiny-vl", max_output_tokens=2,
                                    input=[{"role": "user", "content": [part]}])
        assert e.value.body["param"] == param and words in e.value.message, (part, e.value.body)
