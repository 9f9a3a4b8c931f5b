// Assistant messages as rich text, through the libraries vendored in static/vendor/ (loaded
// as classic scripts by index.html; versions and licenses in docs/server.md): markdown-it
// (CommonMark with GFM tables and strikethrough; raw HTML in the text is shown as text, links
// are http(s)/mailto only), maths with markdown-it-texmath and KaTeX ($...$, $$...$$, \(...\),
// \[...\]), code highlighted by highlight.js, the whole cleaned by DOMPurify. Each code
// block gets a Copy button (the clipboard API, else a hidden textarea and execCommand).

const { markdownit, texmath, katex, hljs, DOMPurify } = window;

// Highlighted HTML of a fenced block with a language highlight.js knows; "" (markdown-it
// then escapes the code itself) otherwise: no auto-detection, which is slow on long streams.
function highlight(code, lang) {
  if (!lang || !hljs.getLanguage(lang)) return "";
  try {
    return hljs.highlight(code, { language: lang, ignoreIllegals: true }).value;
  } catch (_) {
    return "";
  }
}

const md = markdownit({ html: false, linkify: false, highlight })
  .use(texmath, { engine: katex, delimiters: ["dollars", "brackets"], katexOptions: { throwOnError: false } });

// Links open in a new tab, without a handle on this page.
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

// Safe HTML for the markdown `text` (a partial stream renders as far as it goes). KaTeX's
// MathML keeps its <semantics> / <annotation> (the TeX source, plain text) for screen readers.
export function renderMarkdown(text) {
  return DOMPurify.sanitize(md.render(text || ""), { ADD_TAGS: ["semantics", "annotation"], ADD_ATTR: ["encoding"] });
}

// Copy `text` to the clipboard; resolves to whether it was copied. navigator.clipboard needs
// a secure context (https or localhost): elsewhere (a LAN address over http) a selected
// hidden textarea and document.execCommand("copy") do it.
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    try {
      await navigator.clipboard.writeText(text);
      return true;
    } catch (_) { /* refused: try the textarea */ }
  }
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.style.cssText = "position: fixed; top: 0; left: 0; opacity: 0;";
  document.body.append(area);
  area.select();
  let copied = false;
  try {
    copied = document.execCommand("copy");
  } catch (_) { /* not supported */ }
  area.remove();
  return copied;
}

// A button that copies `getText()` and says "Copied" (or "Copy failed") for a moment.
export function copyButton(cls, getText) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = cls;
  b.textContent = "Copy";
  b.addEventListener("click", async () => {
    b.textContent = (await copyText(getText())) ? "Copied" : "Copy failed";
    setTimeout(() => { b.textContent = "Copy"; }, 1500);
  });
  return b;
}

// Give each <pre> code block inside `root` the highlight.js theme's class and a Copy button.
export function addCodeTools(root) {
  for (const pre of root.querySelectorAll("pre")) {
    const code = pre.querySelector("code");
    if (code) code.classList.add("hljs");
    const box = document.createElement("div");
    box.className = "code-block";
    pre.replaceWith(box);
    box.append(pre, copyButton("copy-code", () => (code || pre).textContent));
  }
}
