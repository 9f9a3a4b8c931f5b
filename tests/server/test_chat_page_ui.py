"""The chat page's files and what the page draws, on a tiny random Qwen2 served with
``--api-key``: ``/`` and its assets in-process with their content types; the page open
without a key while ``/v1`` is guarded, the API's 401 message shown, the key kept in
localStorage and sent as Bearer; markdown escaped and rendered; reasoning folded, tool
calls and a mid-stream error shown (those streams are served to the page by Playwright's
``route``, since a random model neither reasons nor calls tools); images and videos pasted
or dropped become ``image_url`` / ``video_url`` parts."""

from __future__ import annotations

import base64
import json
import re

import httpx
import pytest

from chat_browser import answer_texts, browser, needs_chromium, open_page, set_settings, stored, wait_answers  # noqa: F401
from helpers import IMAGES
from server_process import TEXT_ARGS, ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.text]
KEY = "page-test-key"
VIDEO = IMAGES.parent / "videos" / "frames_2fps_8.mp4"


@pytest.fixture(scope="module")
def key_server(tiny_models):
    server = ServerProcess(str(tiny_models["qwen2"][0]), *TEXT_ARGS, "--api-key", KEY, name="tiny-qwen2")
    yield server
    server.stop()


def test_page_and_assets_are_served_with_their_content_types():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from atlas_vlm.entrypoints.web import STATIC_DIR, add_web_routes

    app = FastAPI()
    add_web_routes(app)
    client = TestClient(app)
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.text == (STATIC_DIR / "index.html").read_text()
    assert client.head("/").status_code == 200
    linked = re.findall(r'(?:src|href)="/static/([\w./-]+)"', page.text)
    imported = {m for f in STATIC_DIR.glob("*.js") for m in re.findall(r'from "\./([\w.]+)"', f.read_text())}
    assert {n for n in linked if not n.startswith("vendor/")} == {"style.css", "app.js"}
    assert imported == {"api.js", "attach.js", "header.js", "render.js", "richtext.js", "settings.js", "sidebar.js",
                        "store.js"}
    katex_css = (STATIC_DIR / "vendor/katex/katex.min.css").read_text()
    fonts = {f"vendor/katex/{u}" for u in re.findall(r"url\((fonts/[\w-]+\.woff2)\)", katex_css)}
    assert len(fonts) == 20 and {"vendor/katex/katex.min.js", "vendor/dompurify/purify.min.js"} <= set(linked)
    types = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8", ".woff2": "font/woff2"}
    for name in sorted(set(linked) | imported | fonts):
        r = client.get(f"/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"] == types[name[name.rindex("."):]], name
        assert r.content == (STATIC_DIR / name).read_bytes()
    for lib in (STATIC_DIR / "vendor").iterdir():  # each vendored library ships its license
        assert (lib / "LICENSE").is_file(), lib


def test_every_page_file_is_package_data():
    import tomllib
    from pathlib import Path

    from atlas_vlm.entrypoints.web import STATIC_DIR

    root = Path(__file__).resolve().parents[2]
    package = root / "atlas_vlm"
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["atlas_vlm"]
    shipped = {p for pattern in patterns for p in package.glob(pattern) if p.is_file()}  # setuptools' glob
    files = {p for p in STATIC_DIR.rglob("*") if p.is_file()}
    assert files - shipped == set()
    assert sum(p.stat().st_size for p in (STATIC_DIR / "vendor").rglob("*") if p.is_file()) < 1_500_000


def test_page_is_open_and_api_guarded_404_json_and_not_in_the_schema(key_server):
    assert httpx.get(key_server.url + "/", timeout=30).status_code == 200
    assert httpx.get(key_server.url + "/static/app.js", timeout=30).status_code == 200
    assert httpx.get(key_server.url + "/v1/models", timeout=30).status_code == 401
    missing = httpx.get(key_server.url + "/static/missing.js", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Not Found"
    paths = httpx.get(key_server.url + "/openapi.json", timeout=30).json()["paths"]
    assert "/" not in paths and not any(p.startswith("/static") for p in paths)


@needs_chromium
def test_api_key_error_shown_then_kept_and_sent_as_bearer(browser, key_server):
    context = browser.new_context()
    page = open_page(context, key_server)
    assert page.inner_text("#model-name") == "model unknown"
    assert "invalid or missing API key" in page.inner_text("#error")
    set_settings(page, temperature=0, max_tokens=6, markdown=False)
    page.fill("#input", "Hello")
    page.press("#input", "Enter")
    wait_answers(page, 1)
    assert "invalid or missing API key" in page.inner_text(".msg.assistant .error")

    set_settings(page, api_key=KEY)
    page.wait_for_function("document.getElementById('model-name').textContent === 'tiny-qwen2'")
    page.click(".msg.assistant .regenerate")
    wait_answers(page, 1)
    want = key_server.client(api_key=KEY).chat.completions.create(
        model="tiny-qwen2", messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0)
    assert answer_texts(page) == [want.choices[0].message.content]
    assert page.locator(".msg.assistant .error").count() == 0 and page.is_hidden("#error")

    page.reload()
    page.wait_for_function("document.getElementById('model-name').textContent === 'tiny-qwen2'")
    page.click("#open-settings")
    assert page.input_value("#set-api-key") == KEY
    page.keyboard.press("Escape")
    assert page.errors == []
    context.close()


def sse(*chunks) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def delta(**d) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d, "finish_reason": None}]}


@needs_chromium
def test_markdown_reasoning_tool_calls_and_a_stream_error_are_drawn(browser, key_server):
    context = browser.new_context()
    page = open_page(context, key_server)
    render = "s => import('/static/richtext.js').then(m => m.renderMarkdown(s))"
    assert page.evaluate(render, '<img src=x onerror="alert(1)"> [a](javascript:alert(1))') == (
        '<p>&lt;img src=x onerror="alert(1)"&gt; [a](javascript:alert(1))</p>\n')
    html = page.evaluate(render, "**b** *i* `<t>` $x^2$\n- one\n- two\n```py\nx = 1 < 2\n```")
    assert html.startswith('<p><strong>b</strong> <em>i</em> <code>&lt;t&gt;</code> <span class="katex">')
    assert '<annotation encoding="application/x-tex">x^2</annotation>' in html
    assert html.endswith('<ul>\n<li>one</li>\n<li>two</li>\n</ul>\n<pre><code class="language-py">x = <span '
                         'class="hljs-number">1</span> &lt; <span class="hljs-number">2</span>\n</code></pre>\n')
    html = page.evaluate(render, "from $5 to $10, \\(a+b\\)")
    assert html.startswith('<p>from $5 to $10, <span class="katex">') and html.count('class="katex"') == 1
    assert page.evaluate(render, "[doc](https://example.org/a?b=1&c=2)") == (
        '<p><a href="https://example.org/a?b=1&amp;c=2" target="_blank" rel="noopener noreferrer">doc</a></p>\n')

    bodies = []
    streams = [sse(delta(role="assistant", reasoning_content="Think "), delta(reasoning_content="first."),
                   delta(content="**Sunny** in `<Paris>`"),
                   delta(tool_calls=[{"index": 0, "id": "c1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": '{"city": '}}]),
                   delta(tool_calls=[{"index": 0, "function": {"arguments": '"Paris"}'}}])),
               sse(delta(content="partial "), {"error": {"message": "engine step failed (test)", "type": "x",
                                                         "param": None, "code": None}})]

    def fulfil(route):
        bodies.append(json.loads(route.request.post_data))
        route.fulfill(status=200, content_type="text/event-stream", body=streams[len(bodies) - 1])

    page.route("**/v1/chat/completions", fulfil)
    set_settings(page, api_key=KEY)
    page.wait_for_function("document.getElementById('model-name').textContent === 'tiny-qwen2'")
    page.fill("#input", "Weather?")
    page.press("#input", "Enter")
    wait_answers(page, 1)
    msg = ".msg.assistant"
    assert page.inner_html(f"{msg} .content") == "<p><strong>Sunny</strong> in <code>&lt;Paris&gt;</code></p>\n"
    assert page.get_attribute(f"{msg} details", "open") is None
    assert page.text_content(f"{msg} details .reasoning") == "Think first."
    assert page.inner_text(f"{msg} .tool-call") == 'get_weather({"city": "Paris"})'
    assert bodies[0]["stream"] is True and bodies[0]["model"] == "tiny-qwen2"

    page.click(f"{msg} .regenerate")
    wait_answers(page, 1)
    assert page.inner_text(f"{msg} .error") == "engine step failed (test)"
    assert page.inner_text(f"{msg} .content") == "partial"
    assert "engine step failed (test)" in page.inner_text("#error")
    assert page.errors == []
    context.close()


DROP = """([kind, b64, name, type]) => {
  const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
  const dt = new DataTransfer();
  dt.items.add(new File([bytes], name, { type }));
  const target = document.getElementById(kind === 'paste' ? 'input' : 'composer');
  target.dispatchEvent(kind === 'paste' ? new ClipboardEvent('paste', { clipboardData: dt, bubbles: true })
                                        : new DragEvent('drop', { dataTransfer: dt, bubbles: true }));
}"""


@needs_chromium
def test_pasted_and_dropped_media_become_image_and_video_parts(browser, key_server):
    context = browser.new_context()
    page = open_page(context, key_server)
    png = (IMAGES / "aspect_200.png").read_bytes()
    page.evaluate(DROP, ["paste", base64.b64encode(png).decode(), "a.png", "image/png"])
    page.evaluate(DROP, ["drop", base64.b64encode(VIDEO.read_bytes()).decode(), "v.mp4", "video/mp4"])
    page.evaluate(DROP, ["drop", base64.b64encode(b"hello").decode(), "notes.txt", "text/plain"])
    page.wait_for_selector("#attachments video")
    assert "notes.txt: not an image or a video (text/plain)" in page.inner_text("#error")
    bodies = []
    page.route("**/v1/chat/completions", lambda route: (bodies.append(json.loads(route.request.post_data)),
                                                        route.fulfill(status=200, content_type="text/event-stream",
                                                                      body=sse(delta(content="ok")))))
    set_settings(page, api_key=KEY)
    page.fill("#input", "What is shown?")
    page.press("#input", "Enter")
    wait_answers(page, 1)
    assert bodies[0]["messages"] == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(VIDEO.read_bytes()).decode()}},
        {"type": "text", "text": "What is shown?"}]}]
    assert page.locator(".msg.user img").count() == 1 and page.locator(".msg.user video").count() == 1
    assert page.locator("#attachments figure").count() == 0
    assert [len(m.get("attachments", [])) for m in stored(page)[0]["messages"]] == [2, 0]
    assert page.errors == []
    context.close()


@needs_chromium
def test_a_refused_image_is_marked_failed_and_a_plain_message_then_answered(browser, key_server):
    def older_card(route):  # the card without "capabilities" (an older server): Attach is offered
        r = route.fetch()
        if not r.ok:
            return route.fulfill(response=r)
        route.fulfill(json={"object": "list", "data": [{k: v for k, v in m.items() if k != "capabilities"}
                                                        for m in r.json()["data"]]})

    context = browser.new_context()
    context.route("**/v1/models", older_card)
    page = open_page(context, key_server)
    set_settings(page, temperature=0, max_tokens=6, markdown=False, api_key=KEY)
    page.wait_for_function("document.getElementById('model-name').textContent === 'tiny-qwen2'")
    page.evaluate(DROP, ["paste", base64.b64encode((IMAGES / "aspect_200.png").read_bytes()).decode(), "a.png",
                         "image/png"])
    page.wait_for_selector("#attachments img")
    page.fill("#input", "What is shown?")
    page.press("#input", "Enter")
    wait_answers(page, 1)
    assert page.inner_text(".msg.assistant .error").startswith("400: ")  # the text model refuses the image
    assert page.locator(".msg.user.failed .failed-note").count() == 1
    page.fill("#input", "Hello")
    page.press("#input", "Enter")
    wait_answers(page, 2)
    want = key_server.client(api_key=KEY).chat.completions.create(
        model="tiny-qwen2", messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0)
    assert answer_texts(page)[1] == want.choices[0].message.content
    assert page.locator(".msg.assistant:last-child .error").count() == 0
    assert [m.get("failed", False) for m in stored(page)[0]["messages"]] == [True, False, False, False]
    assert page.errors == []
    context.close()


@needs_chromium
def test_import_refuses_attachments_that_are_not_media_data_urls(browser, key_server, tmp_path):
    context = browser.new_context()
    page = open_page(context, key_server)
    png = "data:image/png;base64," + base64.b64encode((IMAGES / "aspect_200.png").read_bytes()).decode()
    page.wait_for_selector("#error:not([hidden])")  # the 401 of GET /v1/models without the key, then cleared:
    page.evaluate("document.getElementById('error').hidden = true")  # the import's own error is awaited below
    for url, kind, ok in (("javascript:alert(1)", "image", False), (png, "video", False), (png, "image", True)):
        export = tmp_path / "export.json"
        export.write_text(json.dumps({"conversations": [{"title": "T", "updated": 1, "messages": [
            {"role": "user", "content": "see", "attachments": [{"kind": kind, "url": url, "name": "a.png"}]}]}]}))
        page.set_input_files("#import-file", str(export))
        if ok:
            page.click("#conversations .title >> text=T")
            page.wait_for_selector(".msg.user img")
            assert page.get_attribute(".msg.user img", "src") == png and page.is_hidden("#error")
        else:
            page.wait_for_selector("#error:not([hidden])")
            assert "conversation 0, message 0: an attachment needs" in page.inner_text("#error")
            assert stored(page) == []
            page.evaluate("document.getElementById('error').hidden = true")
    assert [c["title"] for c in stored(page)] == ["T"] and page.errors == []
    context.close()
