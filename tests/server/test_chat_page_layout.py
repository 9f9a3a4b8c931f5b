"""The chat page's layout, rich text and model-card logic in Debian's Chromium, with no
server process: Playwright's ``route`` serves the page's files from the package and answers
``GET /v1/models`` and ``POST /v1/chat/completions`` with the cards and streams each test
chooses (the ``capabilities`` / ``random_weights`` fields another branch adds to the
server's cards, and a 400 for a refused image). At a phone's 390 x 844 and at 1280 x 800:
no horizontal scroll, the sidebar folds, Send and Settings in view, the message box full
width; a GFM table, KaTeX maths, highlighted code with a working Copy button; Attach only
for a model that takes images; a refused attachment leaves the conversation usable; the
context used. Screenshots: /tmp/page-390.png and
/tmp/page-1280.png."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace
from urllib.parse import urlparse

import pytest

from chat_browser import browser, needs_chromium, open_page, set_settings, stored, wait_answers  # noqa: F401
from helpers import IMAGES

pytestmark = [pytest.mark.text, needs_chromium]

ORIGIN = "http://localhost:8765"  # never dialled: every request is fulfilled by route (localhost: a secure context)
TEXT_CARD = {"id": "tiny-text", "object": "model", "max_model_len": 2048, "capabilities": ["text"],
             "quantization": None, "random_weights": True}
VL_CARD = {**TEXT_CARD, "id": "tiny-vl", "capabilities": ["text", "image", "video"], "random_weights": False}
RICH = ("| a | b |\n|---|---|\n| 1 | 2 |\n\nSo $x^2$ grows.\n\n```python\ndef f(x):\n    return x ** 2\n```\n"
        "<img src=x onerror=alert(1)> [bad](javascript:alert(1)) [doc](https://example.org/)")
DROP = """b64 => {
  const dt = new DataTransfer();
  dt.items.add(new File([Uint8Array.from(atob(b64), c => c.charCodeAt(0))], 'a.png', { type: 'image/png' }));
  document.getElementById('input').dispatchEvent(new ClipboardEvent('paste', { clipboardData: dt, bubbles: true }));
}"""


def sse(*chunks) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def chunk(content=None, usage=None) -> dict:
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}, "finish_reason": None}]
    return {"object": "chat.completion.chunk", "choices": choices, "usage": usage}


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def fake_server(context, card: dict, replies: list) -> list[dict]:
    """Route ``context``'s requests to ORIGIN: the page's files from the package, ``card`` as
    the one model, and each chat request answered by the next of ``replies`` ((status, body)
    pairs); returns the list the chat request bodies are appended to."""
    from atlas_vlm.entrypoints.web import STATIC_DIR

    bodies = []

    def handle(route):
        path = urlparse(route.request.url).path
        if path == "/v1/models":
            return route.fulfill(json={"object": "list", "data": [card]})
        if path == "/v1/chat/completions":
            bodies.append(json.loads(route.request.post_data))
            status, body = replies[len(bodies) - 1]
            return route.fulfill(status=status, body=body,
                                 content_type="text/event-stream" if status == 200 else "application/json")
        file = STATIC_DIR / ("index.html" if path == "/" else path.removeprefix("/static/"))
        return route.fulfill(path=file) if file.is_file() else route.fulfill(status=404, body="not found")

    context.route(f"{ORIGIN}/**", handle)
    return bodies


def layout(page) -> dict:
    """What the layout tests look at: scroll width, the buttons' boxes, the input's width."""
    return page.evaluate("""() => {
      const box = id => { const r = document.getElementById(id).getBoundingClientRect();
                          return [r.left, r.top, r.right, r.bottom]; };
      return { scrollWidth: document.scrollingElement.scrollWidth, width: innerWidth, height: innerHeight,
               send: box('send'), settings: box('open-settings'), input: box('input'), composer: box('composer'),
               sidebar: box('sidebar') };
    }""")


def in_view(box, width, height) -> bool:
    left, top, right, bottom = box
    return 0 <= left < right <= width and 0 <= top < bottom <= height


@pytest.mark.parametrize("width,height", [(390, 844), (1280, 800)])
def test_layout_rich_text_and_copy_at_phone_and_desktop_width(browser, width, height):
    context = browser.new_context(viewport={"width": width, "height": height})
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=ORIGIN)
    fake_server(context, TEXT_CARD, [(200, sse(chunk(RICH), chunk(usage=usage(30, 42))))])
    page = open_page(context, SimpleNamespace(url=ORIGIN))
    assert page.inner_text("#model-name") == "tiny-text"
    assert page.is_hidden("#attach") and page.is_visible("#notice")  # a text-only model with random weights
    page.fill("#input", "Show me a table, maths and code.")
    page.press("#input", "Enter")
    wait_answers(page, 1)
    msg = ".msg.assistant .content"
    assert page.inner_text(f"{msg} table th") == "a" and page.locator(f"{msg} table td").count() == 2
    assert page.locator(f"{msg} .katex").count() == 1 and "x" in page.inner_text(f"{msg} .katex .katex-html")
    assert page.locator(f"{msg} pre code.hljs .hljs-keyword").count() >= 1  # `def`, `return`
    assert page.locator(f"{msg} img").count() == 0 and "<img src=x" in page.inner_text(msg)  # raw HTML is text
    assert page.get_attribute(f"{msg} a", "href") == "https://example.org/" and page.locator(f"{msg} a").count() == 1
    assert page.get_attribute(f"{msg} a", "rel") == "noopener noreferrer"
    assert page.inner_text("#context-usage") == "72 / 2048 tokens"
    page.click(f"{msg} .code-block .copy-code")
    page.wait_for_function("document.querySelector('.copy-code').textContent === 'Copied'")
    assert page.evaluate("navigator.clipboard.readText()") == "def f(x):\n    return x ** 2\n"

    geo = layout(page)
    assert geo["scrollWidth"] <= geo["width"]
    assert in_view(geo["send"], width, height) and in_view(geo["settings"], width, height)
    assert geo["input"][2] - geo["input"][0] >= geo["composer"][2] - geo["composer"][0] - (40 if width < 700 else 300)
    sidebar_shown = geo["sidebar"][2] > 0 and page.is_visible("#sidebar")
    assert sidebar_shown == (width >= 700)  # folded on a phone, open on a desktop
    page.screenshot(path=f"/tmp/page-{width}.png")
    page.click("#toggle-sidebar")
    page.wait_for_function("document.getElementById('sidebar').getBoundingClientRect().left >= 0" if width < 700
                           else "getComputedStyle(document.getElementById('sidebar')).display === 'none'")
    assert layout(page)["scrollWidth"] <= width
    if width < 700:
        page.screenshot(path="/tmp/page-390-sidebar.png")
        page.click("#new-chat")  # picking a chat folds it again
        page.wait_for_function("getComputedStyle(document.getElementById('sidebar')).visibility === 'hidden'")
    assert page.errors == []
    context.close()


def test_refused_image_is_not_resent_and_the_context_used_is_shown(browser):
    context = browser.new_context(viewport={"width": 390, "height": 844})
    refused = json.dumps({"error": {"message": "this model takes no images", "type": "invalid_request_error",
                                    "param": "messages", "code": "invalid_image"}})
    bodies = fake_server(context, {"id": "old", "object": "model", "max_model_len": 512},  # an older server's card
                         [(400, refused), (200, sse(chunk("Hi"), chunk(" there"), chunk(usage=usage(9, 2))))])
    page = open_page(context, SimpleNamespace(url=ORIGIN))
    assert page.is_visible("#attach") and page.is_hidden("#notice")  # no capabilities: Attach as before
    page.evaluate(DROP, base64.b64encode((IMAGES / "aspect_200.png").read_bytes()).decode())
    page.wait_for_selector("#attachments img")
    page.fill("#input", "What is this?")
    page.press("#input", "Enter")
    wait_answers(page, 1)
    assert "this model takes no images" in page.inner_text(".msg.assistant .error")
    assert page.locator(".msg.user.failed .failed-note").count() == 1
    page.fill("#input", "Hello")
    page.press("#input", "Enter")
    wait_answers(page, 2)
    assert bodies[1]["messages"] == [{"role": "user", "content": "Hello"}]  # the refused message is left out
    assert page.inner_text(".msg.assistant:last-child .content") == "Hi there"
    assert [m.get("failed", False) for m in stored(page)[0]["messages"]] == [True, False, False, False]
    assert page.inner_text("#context-usage") == "11 / 512 tokens"
    assert page.errors == []
    context.close()
