"""The chat page on the tiny random Qwen2.5-VL server: an image, then a video, picked with
the page's file picker, are sent as ``data:`` URL parts, and what streams into the page
equals the API's greedy answer for the same image or video and text."""

from __future__ import annotations

import base64

import pytest

from chat_browser import answer_texts, browser, needs_chromium, open_page, send, set_settings, stored  # noqa: F401
from helpers import IMAGES

pytestmark = [pytest.mark.server, pytest.mark.vlm, needs_chromium]

PHOTO = IMAGES / "grace_hopper.jpg"
CLIP = IMAGES.parent / "videos" / "frames_2fps_8.mp4"


def api_answer(server, kind: str, url: str, text: str, n: int) -> str:
    part = {"type": f"{kind}_url", f"{kind}_url": {"url": url}}
    r = server.client().chat.completions.create(model="tiny-vl", max_tokens=n, temperature=0, messages=[
        {"role": "user", "content": [part, {"type": "text", "text": text}]}])
    return r.choices[0].message.content


@pytest.mark.parametrize(("kind", "path", "mime"), [("image", PHOTO, "image/jpeg"), ("video", CLIP, "video/mp4")])
def test_picked_media_answer_equals_the_api(browser, vlm_server, kind, path, mime):
    context = browser.new_context()
    page = open_page(context, vlm_server)
    assert page.inner_text("#model-name") == "tiny-vl"
    set_settings(page, temperature=0, max_tokens=8, markdown=False)
    page.set_input_files("#attach-file", str(path))
    page.wait_for_selector(f"#attachments {'img' if kind == 'image' else 'video'}")
    text = "Describe this image." if kind == "image" else "What happens in the clip?"
    send(page, text, 1)
    url = f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()
    want = api_answer(vlm_server, kind, url, text, 8)
    assert want and answer_texts(page) == [want]
    user = stored(page)[0]["messages"][0]
    assert user["attachments"] == [{"kind": kind, "url": url, "name": path.name}] and user["content"] == text
    assert page.errors == [] and page.is_hidden("#error")
    context.close()
