// Conversations and settings kept in this browser (localStorage), and JSON export/import.
// A conversation: {id, title, created, updated, messages: [{role, content, attachments?,
// reasoning?, toolCalls?, error?, stopped?, usage?, failed?}]} (failed: a user message the
// server refused, left out of later requests); attachments are {kind: "image" | "video",
// url: a data: URL, name}.

const CONVERSATIONS = "atlas-vlm.conversations";
const SETTINGS = "atlas-vlm.settings";
export const DEFAULT_SETTINGS = { system: "", temperature: 0.8, maxTokens: "", markdown: true, apiKey: "" };

function read(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value === null ? fallback : value;
  } catch (_) {
    return fallback;
  }
}

export function loadSettings() {
  return { ...DEFAULT_SETTINGS, ...read(SETTINGS, {}) };
}

export function saveSettings(settings) {
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
}

// Every conversation, the most recently updated first.
export function loadConversations() {
  const list = read(CONVERSATIONS, []);
  return (Array.isArray(list) ? list : []).sort((a, b) => b.updated - a.updated);
}

// Save the whole list; throws the browser's QuotaExceededError when it does not fit (large
// attachments), which the page shows.
export function saveConversations(list) {
  localStorage.setItem(CONVERSATIONS, JSON.stringify(list));
}

export function newConversation() {
  const now = Date.now();
  return { id: `c${now.toString(36)}${Math.random().toString(36).slice(2, 8)}`, title: "New chat",
           created: now, updated: now, messages: [] };
}

// A title from the first user message: its first line, at most 40 characters.
export function titleFrom(text) {
  const line = (text || "").trim().split("\n")[0];
  return line.length > 40 ? `${line.slice(0, 39)}…` : line || "New chat";
}

// Parse an export (a list of conversations, or {conversations: [...]}); throws an Error
// naming what is wrong. Imported conversations get fresh ids when theirs are taken.
export function parseExport(text, existing) {
  let data;
  try {
    data = JSON.parse(text);
  } catch (e) {
    throw new Error(`the file is not JSON (${e.message})`);
  }
  const list = Array.isArray(data) ? data : data && data.conversations;
  if (!Array.isArray(list)) throw new Error("the file holds no list of conversations");
  const taken = new Set(existing.map((c) => c.id));
  return list.map((c, i) => {
    if (!c || typeof c !== "object" || !Array.isArray(c.messages)) {
      throw new Error(`conversation ${i} has no "messages" list`);
    }
    for (const [j, m] of c.messages.entries()) {
      if (!m || !["user", "assistant"].includes(m.role) || typeof m.content !== "string") {
        throw new Error(`conversation ${i}, message ${j}: needs role "user" or "assistant" and a string content`);
      }
      for (const a of m.attachments || []) {  // only media data: URLs are shown and sent again
        if (!a || !["image", "video"].includes(a.kind) || typeof a.url !== "string" || !a.url.startsWith(`data:${a.kind}/`)) {
          throw new Error(`conversation ${i}, message ${j}: an attachment needs kind "image" or "video" `
                          + "and a data:image/... or data:video/... url of that kind");
        }
      }
    }
    const fresh = newConversation();
    const id = typeof c.id === "string" && !taken.has(c.id) ? c.id : fresh.id;
    taken.add(id);
    return { ...fresh, ...c, id, title: String(c.title || "Imported chat"), updated: Number(c.updated) || fresh.updated };
  });
}

export function exportJSON(list) {
  return JSON.stringify({ format: "atlas-vlm-chat", version: 1, conversations: list }, null, 2);
}
