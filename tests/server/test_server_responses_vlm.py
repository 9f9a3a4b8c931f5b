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
