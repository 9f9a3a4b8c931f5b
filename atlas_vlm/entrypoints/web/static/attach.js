// Attachments: images and videos from the file picker, a paste or a drop, read as data: URLs
// (sent as image_url / video_url parts, the way the server's docs/server.md describes).

// {kind, url, name} for one File; rejects with an Error naming the file when it is neither
// an image nor a video or cannot be read.
export function readAttachment(file) {
  const kind = file.type.startsWith("image/") ? "image" : file.type.startsWith("video/") ? "video" : null;
  if (!kind) return Promise.reject(new Error(`${file.name || "the file"}: not an image or a video (${file.type || "unknown type"})`));
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve({ kind, url: reader.result, name: file.name || kind });
    reader.onerror = () => reject(new Error(`${file.name}: could not be read`));
    reader.readAsDataURL(file);
  });
}

// An <img> or <video> element showing one attachment.
export function mediaElement(att) {
  const el = document.createElement(att.kind === "video" ? "video" : "img");
  el.src = att.url;
  if (att.kind === "video") el.controls = true;
  else el.alt = att.name;
  el.title = att.name;
  return el;
}

// The request's content for one user message: a plain string without attachments, else
// the media parts first, then the text part.
export function userContent(msg) {
  const media = msg.attachments || [];
  if (media.length === 0) return msg.content;
  return [...media.map((a) => (a.kind === "video"
    ? { type: "video_url", video_url: { url: a.url } }
    : { type: "image_url", image_url: { url: a.url } })),
  { type: "text", text: msg.content }];
}

// Call `onFiles(files)` for files picked, pasted into `pasteTarget` or dropped on `dropZone`.
export function watchFiles(picker, pasteTarget, dropZone, onFiles) {
  picker.addEventListener("change", () => { onFiles([...picker.files]); picker.value = ""; });
  pasteTarget.addEventListener("paste", (e) => {
    const files = [...(e.clipboardData ? e.clipboardData.files : [])];
    if (files.length) { e.preventDefault(); onFiles(files); }
  });
  dropZone.addEventListener("dragover", (e) => { e.preventDefault(); dropZone.classList.add("drop"); });
  dropZone.addEventListener("dragleave", () => dropZone.classList.remove("drop"));
  dropZone.addEventListener("drop", (e) => {
    e.preventDefault();
    dropZone.classList.remove("drop");
    onFiles([...e.dataTransfer.files]);
  });
}

// Draw the attachments waiting to be sent into `box`, each with a × button: `onRemove(i)`.
export function drawAttachments(box, pending, onRemove) {
  box.replaceChildren(...pending.map((att, i) => {
    const fig = document.createElement("figure");
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.title = `Remove ${att.name}`;
    remove.addEventListener("click", () => onRemove(i));
    fig.append(mediaElement(att), remove);
    return fig;
  }));
}
