"""Driving the chat page (``GET /`` of ``atlas-vlm serve``) in Debian's Chromium through
Playwright: the browser fixture (skipped, with the reason, only where /usr/bin/chromium is
absent; Playwright's own browser download is never used), and the page's actions as the
tests need them. Every wait is bounded."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 240_000  # a streamed answer on a busy 2-core machine
needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is absent: the chat page tests drive "
                                    "Debian's chromium (scripts/setup.sh installs it as root with apt-get)")


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium for the module's tests."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is absent (scripts/setup.sh installs Debian's chromium as root with apt-get)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


def open_page(context, server):
    """The chat page of ``server`` in a new tab of ``context``, its model name loaded (or the
    attempt failed); page errors are collected in ``page.errors``."""
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.set_default_timeout(WAIT_MS)
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model-name').textContent !== '…'")
    return page


def set_settings(page, *, system=None, temperature=None, max_tokens=None, markdown=None, api_key=None):
    """Fill the settings dialog (only the fields given) and save it."""
    page.click("#open-settings")
    for sel, value in (("#set-system", system), ("#set-temperature", temperature), ("#set-max-tokens", max_tokens),
                       ("#set-api-key", api_key)):
        if value is not None:
            page.fill(sel, str(value))
    if markdown is not None:
        page.set_checked("#set-markdown", markdown)
    page.click("#save-settings")


def wait_answers(page, n: int) -> None:
    """Wait until the page shows ``n`` assistant messages and no stream runs."""
    page.wait_for_function(f"""() => !document.getElementById('send').hidden
        && document.querySelectorAll('.msg.assistant').length === {n}""")


def send(page, text: str, answers: int) -> None:
    """Type ``text`` (newlines with Shift+Enter), press Enter, wait for ``answers`` answers."""
    page.click("#input")
    for i, line in enumerate(text.split("\n")):
        if i:
            page.keyboard.press("Shift+Enter")
        page.keyboard.insert_text(line)
    page.keyboard.press("Enter")
    wait_answers(page, answers)


def answer_texts(page) -> list[str]:
    """The raw text of each assistant message as shown (markdown off: text as streamed)."""
    return page.eval_on_selector_all(".msg.assistant .content", "els => els.map(e => e.textContent)")


def stored(page) -> list[dict]:
    """The conversations the page keeps in localStorage."""
    return json.loads(page.evaluate("localStorage.getItem('atlas-vlm.conversations') || '[]'"))


def wait_for(pred, what: str, limit_s: float = WAIT_MS / 1000) -> None:
    """Poll ``pred()`` every 0.1 s until true; AssertionError naming ``what`` after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
