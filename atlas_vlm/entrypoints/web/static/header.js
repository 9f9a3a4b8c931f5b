// The header's parts: what the model's card (GET /v1/models) says (Attach only for the media
// the model takes, the random-weights notice), the context a conversation uses, and the
// sidebar's fold (over the chat on a phone, beside it on a wider screen).
import { mediaKinds } from "./api.js";

const $ = (id) => document.getElementById(id);
export const phone = window.matchMedia("(max-width: 700px)");

// Show Attach (and the picker's accepted types) and the notice for `card` (null: unknown).
export function drawModelInfo(card) {
  const kinds = mediaKinds(card);
  $("attach").hidden = kinds.length === 0;
  $("attach-file").accept = kinds.map((k) => `${k}/*`).join(",");
  $("notice").hidden = !(card && card.random_weights === true);
}

// "used / max_model_len tokens": the context `conv` holds as its last answer's usage counts
// it (prompt + completion, running while it streams); hidden when neither is known.
export function drawUsage(conv, card) {
  const last = conv && conv.messages.findLast((m) => m.usage);
  const max = card && card.max_model_len;
  const used = last ? last.usage.total_tokens ?? last.usage.prompt_tokens + last.usage.completion_tokens : 0;
  $("context-usage").textContent = max ? `${used} / ${max} tokens` : `${used} tokens`;
  $("context-usage").hidden = !last && !max;
}

export function sidebarShown() {
  return phone.matches ? document.body.classList.contains("sidebar-open")
    : !document.body.classList.contains("sidebar-closed");
}

// Show or fold the sidebar (a phone: body.sidebar-open; wider: body.sidebar-closed).
export function showSidebar(show) {
  if (phone.matches) document.body.classList.toggle("sidebar-open", show);
  else document.body.classList.toggle("sidebar-closed", !show);
  $("toggle-sidebar").setAttribute("aria-expanded", String(show));
}

// The ☰ button toggles the sidebar; on a phone a click on the chat or Escape folds it.
export function wireSidebar() {
  $("toggle-sidebar").addEventListener("click", (e) => { e.stopPropagation(); showSidebar(!sidebarShown()); });
  document.querySelector("main").addEventListener("click", () => {
    if (phone.matches && sidebarShown()) showSidebar(false);
  });
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && phone.matches) showSidebar(false); });
  showSidebar(!phone.matches);
}
