// A small, safe markdown renderer: the text is HTML-escaped first, so only the tags made
// here can appear. Fenced code blocks, inline code, headings, bold/italic, bullet and
// numbered lists, links (http, https and mailto only), and maths kept as text in a styled
// span ($...$, \(...\)) or block ($$...$$, \[...\]).

export function escapeHtml(text) {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

const SAFE_URL = /^(https?:\/\/|mailto:)/i;

// Inline markup of one escaped line: code and maths are set aside first (nothing inside
// them is markup), then links, bold and italic.
function inline(text) {
  const kept = [];
  const keep = (html) => `\u0000${kept.push(html) - 1}\u0000`;
  let s = text.replace(/`([^`]+)`/g, (_, code) => keep(`<code>${code}</code>`));
  // $...$ hugs its text and is not followed by a digit, so "$5 and $10" stay prices
  s = s.replace(/\$(?=\S)[^$\n]+?(?<=\S)\$(?!\d)|\\\((.+?)\\\)/g, (m) => keep(`<span class="math">${m}</span>`));
  s = s.replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (m, label, url) => SAFE_URL.test(url)
    ? keep(`<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`) : m);
  s = s.replace(/\*\*(\S(?:.*?\S)?)\*\*|__(\S(?:.*?\S)?)__/g, (_, a, b) => `<strong>${a ?? b}</strong>`);
  s = s.replace(/(^|[^*\w])\*(\S(?:.*?\S)?)\*(?!\*)|(^|\W)_(\S(?:.*?\S)?)_(?!\w)/g,
    (_, p1, a, p2, b) => `${p1 ?? p2}<em>${a ?? b}</em>`);
  // eslint-disable-next-line no-control-regex
  return s.replace(/\u0000(\d+)\u0000/g, (_, i) => kept[Number(i)]);
}

const FENCE = /^\s*```\s*([\w+-]*)/;
const LIST_ITEM = /^(\s*)([-*+]|\d+[.)])\s+(.*)$/;
const MATH_OPEN = { "$$": "$$", "\\[": "\\]" };

// HTML for markdown `src`; an unclosed fence or maths block (a stream still arriving)
// runs to the end.
export function renderMarkdown(src) {
  const lines = escapeHtml(src).split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    const mathOpen = MATH_OPEN[line.trim()];
    if (fence) {
      const body = [];
      for (i += 1; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i += 1) body.push(lines[i]);
      i += 1;
      const lang = fence[1] ? ` class="language-${fence[1]}"` : "";
      out.push(`<pre><code${lang}>${body.join("\n")}</code></pre>`);
    } else if (mathOpen) {
      const body = [];
      for (i += 1; i < lines.length && lines[i].trim() !== mathOpen; i += 1) body.push(lines[i]);
      i += 1;
      out.push(`<div class="math">${line.trim()}${body.join("\n")}${mathOpen}</div>`);
    } else if (/^#{1,6}\s/.test(line)) {
      const level = line.match(/^#+/)[0].length;
      out.push(`<h${level}>${inline(line.slice(level).trim())}</h${level}>`);
      i += 1;
    } else if (LIST_ITEM.test(line)) {
      const isOrdered = (l) => /\d/.test(l.match(LIST_ITEM)[2]);
      const ordered = isOrdered(line);
      const items = [];
      for (; i < lines.length && LIST_ITEM.test(lines[i]) && isOrdered(lines[i]) === ordered; i += 1) {
        items.push(`<li>${inline(lines[i].match(LIST_ITEM)[3])}</li>`);
      }
      out.push(ordered ? `<ol>${items.join("")}</ol>` : `<ul>${items.join("")}</ul>`);
    } else if (line.trim() === "") {
      i += 1;
    } else {
      const para = [];
      for (; i < lines.length && lines[i].trim() !== "" && !FENCE.test(lines[i]) && !LIST_ITEM.test(lines[i])
             && !/^#{1,6}\s/.test(lines[i]) && !MATH_OPEN[lines[i].trim()]; i += 1) para.push(inline(lines[i]));
      out.push(`<p>${para.join("<br>")}</p>`);
    }
  }
  return out.join("\n");
}
