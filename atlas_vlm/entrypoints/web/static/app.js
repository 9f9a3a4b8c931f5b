// The chat page: send a message and stream the answer, Stop, Regenerate, edit and resend,
// settings, conversations kept in this browser, attachments (where the model takes them), the
// context used, a sidebar that folds on a phone. Talks only to this server's /v1/models and
// /v1/chat/completions (api.js).
import { listModels, mediaKinds, streamChat } from "./api.js";
import { readAttachment, mediaElement, userContent, watchFiles } from "./attach.js";
import { addToolCallDeltas, editMessage, fillMessage } from "./render.js";
import { copyText } from "./richtext.js";
import { downloadExport, readImport, renderSidebar } from "./sidebar.js";
import { loadConversations, loadSettings, newConversation, saveConversations, saveSettings, titleFrom } from "./store.js";

const $ = (id) => document.getElementById(id);
const state = { settings: loadSettings(), conversations: loadConversations(), currentId: null, model: null,
                card: null, controller: null, pending: [] };
const phone = window.matchMedia("(max-width: 700px)");

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
    state.card = cards[0] || null;
    state.model = state.card ? state.card.id : null;
    $("model-name").textContent = state.model || "no model served";
    return state.model ? null : "the server serves no model";
  } catch (e) {
    state.card = null;
    state.model = null;
    $("model-name").textContent = "model unknown";
    showError(e.message);
    return e.message;
  } finally {
    drawModelInfo();
  }
}

// Attach only for a model that takes images or videos; the random-weights notice.
function drawModelInfo() {
  const kinds = mediaKinds(state.card);
  $("attach").hidden = kinds.length === 0;
  $("attach-file").accept = kinds.map((k) => `${k}/*`).join(",");
  $("notice").hidden = !(state.card && state.card.random_weights === true);
  drawUsage();
}

// "used / max_model_len tokens": the context the current conversation holds, as the last
// answer's usage counts it (prompt + completion, running while it streams).
function drawUsage() {
  const conv = current();
  const last = conv && conv.messages.findLast((m) => m.usage);
  const max = state.card && state.card.max_model_len;
  const used = last ? last.usage.total_tokens ?? last.usage.prompt_tokens + last.usage.completion_tokens : 0;
  $("context-usage").textContent = max ? `${used} / ${max} tokens` : `${used} tokens`;
  $("context-usage").hidden = !last && !max;
}

function showSidebar(show) {
  document.body.classList.toggle(phone.matches ? "sidebar-open" : "sidebar-closed", phone.matches ? show : !show);
  $("toggle-sidebar").setAttribute("aria-expanded", String(show));
}

function sidebarShown() {
  return phone.matches ? document.body.classList.contains("sidebar-open")
    : !document.body.classList.contains("sidebar-closed");
}

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
  drawUsage();
}

function drawPending() {
  $("attachments").replaceChildren(...state.pending.map((att, i) => {
    const fig = document.createElement("figure");
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.title = `Remove ${att.name}`;
    remove.addEventListener("click", () => { state.pending.splice(i, 1); drawPending(); });
    fig.append(mediaElement(att), remove);
    return fig;
  }));
}

// ---- chatting --------------------------------------------------------------------------
function requestBody(conv) {
  const s = state.settings;
  const messages = s.system.trim() ? [{ role: "system", content: s.system }] : [];
  for (const m of conv.messages.slice(0, -1)) {  // a refused message (failed) and its error are left out
    if (m.role === "user" && !m.failed) messages.push({ role: "user", content: userContent(m) });
    else if (m.role === "assistant" && (!m.error || m.content)) messages.push({ role: "assistant", content: m.content });
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
    requestAnimationFrame(() => { queued = false; drawMessage(conv, conv.messages.indexOf(answer), el); drawUsage(); });
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
function openSettings() {
  const s = state.settings;
  $("set-system").value = s.system;
  $("set-temperature").value = s.temperature ?? "";
  $("set-max-tokens").value = s.maxTokens ?? "";
  $("set-markdown").checked = s.markdown;
  $("set-api-key").value = s.apiKey;
  $("settings").returnValue = "";
  $("settings").showModal();
}

function closeSettings() {
  if ($("settings").returnValue !== "save") return;
  const keyChanged = $("set-api-key").value !== state.settings.apiKey;
  state.settings = { system: $("set-system").value, temperature: $("set-temperature").value,
                     maxTokens: $("set-max-tokens").value, markdown: $("set-markdown").checked,
                     apiKey: $("set-api-key").value };
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
$("toggle-sidebar").addEventListener("click", (e) => { e.stopPropagation(); showSidebar(!sidebarShown()); });
document.querySelector("main").addEventListener("click", () => { if (phone.matches && sidebarShown()) showSidebar(false); });
document.addEventListener("keydown", (e) => { if (e.key === "Escape" && phone.matches) showSidebar(false); });
$("open-settings").addEventListener("click", openSettings);
$("settings").addEventListener("close", closeSettings);
$("attach").addEventListener("click", () => $("attach-file").click());
watchFiles($("attach-file"), $("input"), $("composer"), async (files) => {
  try {
    for (const f of files) {
      const att = await readAttachment(f);
      if (!mediaKinds(state.card).includes(att.kind)) throw new Error(`${att.name}: ${state.model} takes no ${att.kind}s`);
      state.pending.push(att);
    }
  } catch (e) {
    showError(e.message);
  }
  drawPending();
});
$("export").addEventListener("click", () => downloadExport(state.conversations));
$("import").addEventListener("click", () => $("import-file").click());
$("import-file").addEventListener("change", async () => {
  const file = $("import-file").files[0];
  $("import-file").value = "";
  if (!file) return;
  try {
    const added = await readImport(file, state.conversations);
    state.conversations = [...added, ...state.conversations];
    persist();
    showError("");
    drawAll();
  } catch (e) {
    showError(`import failed: ${e.message}`);
  }
});

state.currentId = state.conversations.length ? state.conversations[0].id : null;
showSidebar(!phone.matches);
drawAll();
refreshModel();
