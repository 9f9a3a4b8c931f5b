// One chat message as page elements: its media, reasoning (folded in <details>), content
// (markdown with copyable code blocks, or raw text), tool calls, error, a refused (failed)
// user message's note and a line of counts, with its buttons.
import { mediaElement } from "./attach.js";
import { addCodeTools, renderMarkdown } from "./richtext.js";

function div(cls, text) {
  const el = document.createElement("div");
  el.className = cls;
  if (text !== undefined) el.textContent = text;
  return el;
}

function button(cls, label, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = cls;
  b.textContent = label;
  b.addEventListener("click", onClick);
  return b;
}

// Append a tool-call delta list (OpenAI's: {index, id, function: {name, arguments}} pieces)
// to `calls`, the calls so far.
export function addToolCallDeltas(calls, deltas) {
  for (const d of deltas) {
    const i = d.index ?? calls.length;
    calls[i] = calls[i] || { id: "", name: "", arguments: "" };
    if (d.id) calls[i].id = d.id;
    if (d.function && d.function.name) calls[i].name += d.function.name;
    if (d.function && d.function.arguments) calls[i].arguments += d.function.arguments;
  }
}

function meta(msg) {
  const parts = [];
  if (msg.usage) parts.push(`${msg.usage.completion_tokens} tokens`);
  if (msg.seconds > 0) parts.push(`${msg.seconds.toFixed(1)} s`);
  if (msg.finish && msg.finish !== "stop") parts.push(`finish: ${msg.finish}`);
  if (msg.stopped) parts.push("stopped");
  return parts.join(" · ");
}

// Fill `el` (a .msg element) with `msg`; `opts`: {markdown, actions: [[class, label, fn]]}.
// A reasoning block the user opened stays open across re-renders of a stream.
export function fillMessage(el, msg, opts) {
  const wasOpen = !!el.querySelector("details[open]");
  el.replaceChildren();
  el.className = `msg ${msg.role}`;
  for (const att of msg.attachments || []) el.append(mediaElement(att));
  if (msg.reasoning) {
    const details = document.createElement("details");
    details.open = wasOpen;
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    details.append(summary, div("reasoning", msg.reasoning));
    el.append(details);
  }
  const content = div(opts.markdown && msg.role === "assistant" ? "content" : "content raw");
  if (content.classList.contains("raw")) content.textContent = msg.content;
  else {
    content.innerHTML = renderMarkdown(msg.content);
    addCodeTools(content);
  }
  el.append(content);
  if (msg.failed) {
    el.classList.add("failed");
    el.append(div("failed-note", "Not answered: left out of later requests (Edit sends it again)"));
  }
  for (const call of msg.toolCalls || []) el.append(div("tool-call", `${call.name}(${call.arguments})`));
  if (msg.error) el.append(div("error", msg.error));
  const line = meta(msg);
  if (line) el.append(div("meta", line));
  if (opts.actions && opts.actions.length) {
    const tools = div("tools");
    for (const [cls, label, fn] of opts.actions) tools.append(button(cls, label, fn));
    el.append(tools);
  }
  return el;
}

// Replace the content of a user message element with an editor; `onSave(text)` resends.
export function editMessage(el, msg, onSave, onCancel) {
  const area = document.createElement("textarea");
  area.className = "edit-text";
  area.value = msg.content;
  area.rows = Math.min(10, msg.content.split("\n").length + 1);
  const tools = div("tools");
  tools.append(button("save-edit", "Save & send", () => onSave(area.value)), button("cancel-edit", "Cancel", onCancel));
  el.querySelector(".content").replaceWith(area);
  el.querySelector(".tools").replaceWith(tools);
  area.focus();
}
