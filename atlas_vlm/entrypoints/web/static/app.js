// The chat page: send a message and stream the answer, Stop, Regenerate, edit and resend,
// settings, conversations kept in this browser, attachments (where the model takes them), the
// context used, a sidebar that folds on a phone. Talks only to this server's /v1/models and
// /v1/chat/completions (api.js).
import { listModels, mediaKinds, streamChat } from "./api.js";
import { drawModelInfo, drawUsage, phone, showSidebar, wireSidebar } from "./header.js";
import { drawAttachments, readAttachment, userContent, watchFiles } from "./attach.js";
import { addToolCallDeltas, editMessage, fillMessage } from "./render.js";
import { copyText } from "./richtext.js";
import { renderSidebar, wireExportImport } from "./sidebar.js";
import { openSettingsDialog, readSettingsDialog } from "./settings.js";
import { loadConversations, loadSettings, newConversation, saveConversations, saveSettings, titleFrom } from "./store.js";

const $ = (id) => document.getElementById(id);
const state = { settings: loadSettings(), conversations: loadConversations(), currentId: null, model: null,
                card: null, controller: null, pending: [] };

function showError(message) {
  $("error").textContent = message || "";
  $("error").hidden = !message;
}

function current() {
  return state.conversations.find((c) => c.id === state.currentId) || null;
}

function persist() {
  try {
    saveConversations(state.conversations);
  } catch (e) {
    showError(`could not keep the conversations in this browser: ${e.message}`);
  }
}

// Ask the server for its model; resolves to null, or to the error message (also shown).
async function refreshModel() {
  try {
    const cards = await listModels(state.settings.apiKey);
    // several models: a picker (the choice kept while the server still lists it)
    state.card = cards.find((c) => c.id === state.model) || cards[0] || null;
    state.model = state.card ? state.card.id : null;
    $("model-name").textContent = state.model || "no model served";
    const picker = $("model-picker");
    picker.replaceChildren(...cards.map((c) => new Option(c.id, c.id, false, c.id === state.model)));
    picker.hidden = cards.length < 2;
    $("model-name").hidden = cards.length >= 2;
    picker.onchange = () => refreshModel.pick(cards.find((c) => c.id === picker.value));
    return state.model ? null : "the server serves no model";
  } catch (e) {
    state.card = null;
    state.model = null;
    $("model-name").textContent = "model unknown";
    showError(e.message);
    return e.message;
  } finally {
    drawModelInfo(state.card);
    drawUsage(current(), state.card);
  }
}

// The picker's choice: its card drives Attach, the notice and the context shown.
refreshModel.pick = (card) => {
  state.card = card || null;
  state.model = card ? card.id : null;
  $("model-name").textContent = state.model || "no model served";
  drawModelInfo(state.card);
  drawUsage(current(), state.card);
};

// ---- drawing ---------------------------------------------------------------------------
function actionsFor(conv, i) {
  if (state.controller) return [];
  const msg = conv.messages[i];
  if (msg.role === "user") return [["edit", "Edit", () => startEdit(conv, i)]];
  const acts = [["copy", "Copy", () => copyText(msg.content)]];
  if (i === conv.messages.length - 1) acts.push(["regenerate", "Regenerate", () => regenerate(conv)]);
  return acts;
}

function drawMessage(conv, i, el) {
  return fillMessage(el || document.createElement("div"), conv.messages[i],
                     { markdown: state.settings.markdown, actions: actionsFor(conv, i) });
}

function drawAll() {
  state.conversations.sort((a, b) => b.updated - a.updated);  // the latest first, as on a reload
  const conv = current();
  const box = $("messages");
  box.replaceChildren(...(conv ? conv.messages.map((_, i) => drawMessage(conv, i)) : []));
  box.scrollTop = box.scrollHeight;
  renderSidebar($("conversations"), state.conversations, state.currentId, {
    select: (id) => {
      if (state.controller) return;
      state.currentId = id;
      showError("");
      if (phone.matches) showSidebar(false);
      drawAll();
    },
    rename: (id, title) => { state.conversations.find((c) => c.id === id).title = title; persist(); drawAll(); },
    remove: (id) => {
      state.conversations = state.conversations.filter((c) => c.id !== id);
      if (state.currentId === id) state.currentId = null;
      persist();
      drawAll();
    },
  });
  $("send").hidden = !!state.controller;
  $("stop").hidden = !state.controller;
  drawUsage(conv, state.card);
}

function drawPending() {
  drawAttachments($("attachments"), state.pending, (i) => { state.pending.splice(i, 1); drawPending(); });
}

// ---- chatting --------------------------------------------------------------------------
function requestBody(conv) {
  const s = state.settings;
  const messages = s.system.trim() ? [{ role: "system", content: s.system }] : [];
  for (const m of conv.messages.slice(0, -1)) {  // a refused message (failed) and its error are left out
    if (m.role === "user" && !m.failed) messages.push({ role: "user", content: userContent(m) });
    else if (m.role === "assistant" && (!m.error || m.content)) {
      messages.push({ role: "assistant", content: m.content });
    }
  }
  const body = { model: state.model, messages };
  if (s.temperature !== null && s.temperature !== "") body.temperature = Number(s.temperature);
  if (s.maxTokens) body.max_tokens = Number(s.maxTokens);
  return body;
}

// Stream an answer to the conversation's messages into a new assistant message. When the
// request fails before anything streams (the server refused it: an image to a text model,
// a context overflow, ...), the user message it answers is marked failed: later requests
// leave it out (Regenerate or Edit sends it again).
async function generate(conv) {
  showError("");
  const asked = conv.messages.at(-1);
  if (asked && asked.role === "user") delete asked.failed;
  const answer = { role: "assistant", content: "", reasoning: "", toolCalls: [] };
  conv.messages.push(answer);
  conv.updated = Date.now();
  state.controller = new AbortController();
  persist();
  drawAll();
  const el = $("messages").lastElementChild;
  let queued = false;
  const redraw = () => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => {
      queued = false;
      drawMessage(conv, conv.messages.indexOf(answer), el);
      drawUsage(conv, state.card);
    });
  };
  const started = performance.now();
  try {
    const noModel = state.model ? null : await refreshModel();
    if (noModel) throw new Error(noModel);
    answer.finish = await streamChat(requestBody(conv), state.settings.apiKey, state.controller.signal, (d) => {
      if (d.content) answer.content += d.content;
      if (d.reasoning_content) answer.reasoning += d.reasoning_content;
      if (d.tool_calls) addToolCallDeltas(answer.toolCalls, d.tool_calls);
      redraw();
    }, (usage) => { answer.usage = usage; redraw(); });
  } catch (e) {
    if (e.name === "AbortError") answer.stopped = true;
    else {
      answer.error = e.message;
      showError(e.message);
      const empty = !answer.content && !answer.reasoning && answer.toolCalls.length === 0;
      if (empty && asked && asked.role === "user") asked.failed = true;
    }
  }
  answer.seconds = (performance.now() - started) / 1000;
  state.controller = null;
  conv.updated = Date.now();
  persist();
  drawAll();
}

function send() {
  const text = $("input").value;
  if (state.controller || (!text.trim() && state.pending.length === 0)) return;
  let conv = current();
  if (!conv) {
    conv = newConversation();
    state.conversations.unshift(conv);
    state.currentId = conv.id;
  }
  if (conv.messages.length === 0) conv.title = titleFrom(text || state.pending[0].name);
  conv.messages.push({ role: "user", content: text, attachments: state.pending });
  state.pending = [];
  $("input").value = "";
  drawPending();
  generate(conv);
}

function regenerate(conv) {
  if (conv.messages.at(-1).role === "assistant") conv.messages.pop();
  generate(conv);
}

function startEdit(conv, i) {
  const el = $("messages").children[i];
  editMessage(el, conv.messages[i], (text) => {
    conv.messages[i] = { ...conv.messages[i], content: text };
    conv.messages.length = i + 1;
    if (i === 0) conv.title = titleFrom(text);
    generate(conv);
  }, () => drawAll());
}

// ---- settings --------------------------------------------------------------------------
function closeSettings() {
  if ($("settings").returnValue !== "save") return;
  const keyChanged = $("set-api-key").value !== state.settings.apiKey;
  state.settings = readSettingsDialog();
  saveSettings(state.settings);
  if (keyChanged) { showError(""); refreshModel(); }
  drawAll();
}

// ---- wiring ----------------------------------------------------------------------------
$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("new-chat").addEventListener("click", () => {
  if (state.controller) return;
  state.currentId = null;
  if (phone.matches) showSidebar(false);
  drawAll();
});
$("open-settings").addEventListener("click", () => openSettingsDialog(state.settings));
$("settings").addEventListener("close", closeSettings);
$("attach").addEventListener("click", () => $("attach-file").click());
watchFiles($("attach-file"), $("input"), $("composer"), async (files) => {
  try {
    for (const f of files) {
      const att = await readAttachment(f);
      if (!mediaKinds(state.card).includes(att.kind)) {
        throw new Error(`${att.name}: ${state.model} takes no ${att.kind}s`);
      }
      state.pending.push(att);
    }
  } catch (e) {
    showError(e.message);
  }
  drawPending();
});
wireExportImport(() => state.conversations, (added) => {
  state.conversations = [...added, ...state.conversations];
  persist();
  showError("");
  drawAll();
}, (e) => showError(`import failed: ${e.message}`));

state.currentId = state.conversations.length ? state.conversations[0].id : null;
wireSidebar();
drawAll();
refreshModel();
