"""Anthropic's Messages API with an image on the VLM server (tiny random Qwen2.5-VL): an
``image`` block (base64 with ``media_type``) gives the same prompt and greedy tokens as chat
completions with the same image as a ``data:`` URI; ``count_tokens`` counts its tokens; an
undecodable image is a 400 in Anthropic's shape saying so."""

from __future__ import annotations

import base64

import anthropic
import pytest

from helpers import IMAGES

GREEDY = {"extra_body": {"temperature": 0}}  # the SDK no longer has sampling arguments

pytestmark = [pytest.mark.server, pytest.mark.vlm]

PHOTO = IMAGES / "grace_hopper.jpg"


def _messages(data: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": data}},
        {"type": "text", "text": "Describe this image."}]}]


def test_image_block_same_as_chat_completions(vlm_server):
    data = base64.b64encode(PHOTO.read_bytes()).decode()
    c = anthropic.Anthropic(base_url=vlm_server.url, api_key="none", max_retries=0, timeout=300)
    reply = c.messages.create(model="tiny-vl", messages=_messages(data), max_tokens=6, **GREEDY)
    ref = vlm_server.client().chat.completions.create(
        model="tiny-vl", max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,"
                                                                                      + data}},
                                               {"type": "text", "text": "Describe this image."}]}])
    assert reply.usage.input_tokens == ref.usage.prompt_tokens
    assert reply.content[0].text == ref.choices[0].message.content
    assert reply.usage.output_tokens == ref.usage.completion_tokens
    plain = c.messages.count_tokens(model="tiny-vl", messages=[{"role": "user", "content": "Describe this image."}])
    counted = c.messages.count_tokens(model="tiny-vl", messages=_messages(data))
    assert counted.input_tokens == reply.usage.input_tokens > plain.input_tokens
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="tiny-vl", messages=_messages(base64.b64encode(b"not an image").decode()),
                          max_tokens=2)
    body = e.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "image" in body["error"]["message"].lower()
