"""The chat page at ``/`` in a real browser (Debian's Chromium through Playwright) against
the text server (SmolLM2): what it streams equals the API's greedy answer for the same
request (system prompt, multi-line message, regenerate, edit and resend, a second turn);
Stop ends a stream midway, the server aborts that request and serves on; conversations survive a reload, are
renamed, deleted, exported and imported."""

from __future__ import annotations

import json

import pytest

from chat_browser import (answer_texts, browser, needs_chromium, open_page, send, set_settings, stored,  # noqa: F401
                          wait_answers, wait_for)

pytestmark = [pytest.mark.server, pytest.mark.text, needs_chromium]

SYSTEM = "You are a concise assistant."


def api_reply(server, messages: list[dict], max_tokens: int):
    """The API's greedy, non-streamed answer to the same request."""
    return server.client().chat.completions.create(model="smollm2", messages=messages, max_tokens=max_tokens,
                                                   temperature=0)


def api_answer(server, messages: list[dict], max_tokens: int) -> str:
    return api_reply(server, messages, max_tokens).choices[0].message.content


def test_streamed_answers_equal_the_api_regenerate_edit_and_second_turn(browser, text_server):
    context = browser.new_context()
    page = open_page(context, text_server)
    assert page.inner_text("#model-name") == "smollm2"
    set_settings(page, system=SYSTEM, temperature=0, max_tokens=16, markdown=False)
    first = "What is the capital of France?\nAnswer in one sentence."  # the newline typed with Shift+Enter
    send(page, first, 1)
    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}]
    reply = api_reply(text_server, conv, 16)
    want = reply.choices[0].message.content
    assert want and answer_texts(page) == [want]
    saved = stored(page)
    assert [m["content"] for m in saved[0]["messages"]] == [first, want]
    assert saved[0]["title"] == "What is the capital of France?"
    assert saved[0]["messages"][1]["usage"]["completion_tokens"] == reply.usage.completion_tokens
    assert page.inner_text(".msg.assistant .meta").startswith(f"{reply.usage.completion_tokens} tokens")

    page.click(".msg.assistant .regenerate")  # greedy: the same answer again, in place of the first
    wait_answers(page, 1)
    assert answer_texts(page) == [want]

    edited = "What is the capital of Italy?"
    page.click(".msg.user .edit")
    page.fill(".msg.user .edit-text", edited)
    page.click(".msg.user .save-edit")
    wait_answers(page, 1)
    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": edited}]
    want_edit = api_answer(text_server, conv, 16)
    assert answer_texts(page) == [want_edit] and want_edit != want

    second = "And of Spain?"
    send(page, second, 2)
    conv += [{"role": "assistant", "content": want_edit}, {"role": "user", "content": second}]
    assert answer_texts(page) == [want_edit, api_answer(text_server, conv, 16)]
    assert page.errors == [] and page.is_hidden("#error")
    context.close()


def test_stop_ends_the_stream_midway_and_the_server_serves_on(browser, text_server):
    context = browser.new_context()
    page = open_page(context, text_server)
    set_settings(page, temperature=0, max_tokens=200, markdown=False)
    story = "Write a long story about a knight and a dragon."
    aborted = "atlas:request_success_total{finished_reason=abort}"
    aborts = text_server.metrics().get(aborted, 0)
    page.fill("#input", story)
    page.press("#input", "Enter")
    page.wait_for_function("() => (document.querySelector('.msg.assistant .content') || {}).textContent")
    page.click("#stop")
    wait_answers(page, 1)
    partial = stored(page)[0]["messages"][1]
    assert partial["stopped"] is True and "stopped" in page.inner_text(".msg.assistant .meta")
    counted = partial["usage"]["completion_tokens"]  # the running usage of the last chunk received
    assert counted > 0 and page.inner_text(".msg.assistant .meta").startswith(f"{counted} tokens")
    wait_for(lambda: text_server.metrics().get(aborted, 0) == aborts + 1, "the server to abort the stopped request")
    assert text_server.metrics()["atlas:num_requests_running"] == 0
    full = api_answer(text_server, [{"role": "user", "content": story}], 200)
    assert partial["content"] and full.startswith(partial["content"]) and len(partial["content"]) < len(full)
    assert answer_texts(page) == [partial["content"]]

    page.click("#new-chat")  # the aborted request left the server serving
    set_settings(page, max_tokens=8)
    send(page, "Hello!", 1)
    assert answer_texts(page) == [api_answer(text_server, [{"role": "user", "content": "Hello!"}], 8)]
    assert page.errors == []
    context.close()


def test_conversations_survive_a_reload_rename_delete_export_import(browser, text_server, tmp_path):
    context = browser.new_context(accept_downloads=True)
    page = open_page(context, text_server)
    set_settings(page, temperature=0, max_tokens=6, markdown=False)
    send(page, "Name a colour.", 1)
    answer = answer_texts(page)[0]
    page.click("#new-chat")
    send(page, "Name a fruit.", 1)

    page.reload()
    page.wait_for_function("document.getElementById('model-name').textContent !== '…'")
    titles = page.eval_on_selector_all("#conversations .title", "els => els.map(e => e.textContent)")
    assert titles == ["Name a fruit.", "Name a colour."]
    page.click("#conversations li:nth-child(2) .title")
    assert page.eval_on_selector_all(".msg .content", "els => els.map(e => e.textContent)") == ["Name a colour.", answer]

    page.click("#conversations li.active .rename")
    page.fill("#conversations .rename-input", "Colours")
    page.press("#conversations .rename-input", "Enter")
    page.reload()
    page.wait_for_selector("#conversations .title")
    assert page.eval_on_selector_all("#conversations .title", "els => els.map(e => e.textContent)") == [
        "Name a fruit.", "Colours"]

    with page.expect_download() as download:
        page.click("#export")
    exported = tmp_path / "export.json"
    download.value.save_as(exported)
    data = json.loads(exported.read_text())
    assert [c["title"] for c in data["conversations"]] == ["Name a fruit.", "Colours"]

    page.on("dialog", lambda d: d.accept())  # the delete confirmation
    for _ in range(2):
        page.click("#conversations li:first-child .delete")
    assert stored(page) == [] and page.locator("#conversations li").count() == 0

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"title": "x", "messages": [{"role": "robot", "content": "hi"}]}]))
    page.set_input_files("#import-file", str(bad))
    page.wait_for_selector("#error:not([hidden])")
    assert "conversation 0, message 0" in page.inner_text("#error") and stored(page) == []
    page.set_input_files("#import-file", str(exported))
    page.wait_for_function("document.querySelectorAll('#conversations li').length === 2")
    assert stored(page) == data["conversations"] and page.is_hidden("#error")
    page.click("#conversations .title >> text=Colours")
    assert answer_texts(page) == [answer]
    assert page.errors == []
    context.close()
