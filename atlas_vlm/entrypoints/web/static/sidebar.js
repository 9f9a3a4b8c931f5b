// The conversation list: select, rename (inline), delete (confirmed), export and import.
import { exportJSON, parseExport } from "./store.js";

// Draw `list` into `ul`, `currentId` marked active; `on`: {select(id), rename(id, title),
// remove(id)}.
export function renderSidebar(ul, list, currentId, on) {
  ul.replaceChildren();
  for (const conv of list) {
    const li = document.createElement("li");
    li.dataset.id = conv.id;
    if (conv.id === currentId) li.className = "active";
    const title = document.createElement("span");
    title.className = "title";
    title.textContent = conv.title;
    title.title = conv.title;
    title.addEventListener("click", () => on.select(conv.id));
    const rename = document.createElement("button");
    rename.type = "button";
    rename.className = "rename";
    rename.textContent = "✎";
    rename.title = "Rename";
    rename.addEventListener("click", () => startRename(li, title, conv, on.rename));
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "delete";
    remove.textContent = "×";
    remove.title = "Delete";
    remove.addEventListener("click", () => {
      if (window.confirm(`Delete the conversation "${conv.title}"?`)) on.remove(conv.id);
    });
    li.append(title, rename, remove);
    ul.append(li);
  }
}

function startRename(li, title, conv, onRename) {
  const input = document.createElement("input");
  input.className = "rename-input";
  input.value = conv.title;
  let done = false;
  const finish = (save) => {
    if (done) return;
    done = true;
    const value = input.value.trim();
    if (save && value) onRename(conv.id, value);
    else input.replaceWith(title);
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") finish(true);
    if (e.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
  title.replaceWith(input);
  input.focus();
  input.select();
}

// Download every conversation as one JSON file.
function downloadExport(list) {
  const url = URL.createObjectURL(new Blob([exportJSON(list)], { type: "application/json" }));
  const a = document.createElement("a");
  a.href = url;
  a.download = "atlas-vlm-conversations.json";
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

// Export (every conversation of `getList()`) and Import: `onAdded(conversations)` gets the
// picked file's conversations (parseExport's rules), `onError(error)` its failure.
export function wireExportImport(getList, onAdded, onError) {
  const picker = document.getElementById("import-file");
  document.getElementById("export").addEventListener("click", () => downloadExport(getList()));
  document.getElementById("import").addEventListener("click", () => picker.click());
  picker.addEventListener("change", async () => {
    const file = picker.files[0];
    picker.value = "";
    if (!file) return;
    try {
      onAdded(parseExport(await file.text(), getList()));
    } catch (e) {
      onError(e);
    }
  });
}
