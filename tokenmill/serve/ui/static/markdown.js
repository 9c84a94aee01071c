// A small Markdown renderer for model text: the text is HTML-escaped first, so whatever the model writes is
// shown, never run; the markup added here (code blocks, inline code, emphasis, headings, lists) is ours.
export function escapeHtml(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
          .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

function inline(escaped) {
  // Inline code first, kept out of the emphasis rules by a placeholder.
  const codes = [];
  let s = escaped.replace(/`([^`\n]+)`/g, (_, c) => { codes.push(c); return "\u0000" + (codes.length - 1) + "\u0000"; });
  s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
       .replace(/(^|[^*])\*([^*\n]+)\*/g, "$1<em>$2</em>");
  return s.replace(/\u0000(\d+)\u0000/g, (_, i) => "<code>" + codes[+i] + "</code>");
}

export function renderMarkdown(text) {
  const out = [];
  const parts = text.split(/^```/m);  // even parts: prose; odd parts: a fenced block (first line: its language)
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      const nl = part.indexOf("\n");
      const lang = nl < 0 ? "" : part.slice(0, nl).trim();
      const code = nl < 0 ? "" : part.slice(nl + 1).replace(/\n$/, "");
      const cls = /^[\w+-]+$/.test(lang) ? ` class="language-${lang}"` : "";
      out.push(`<pre><code${cls}>${escapeHtml(code)}</code></pre>`);
      return;
    }
    let list = null;
    const para = [];
    const flush = () => { if (para.length) { out.push("<p>" + para.join("<br>") + "</p>"); para.length = 0; } };
    const endList = () => { if (list) { out.push(`</${list}>`); list = null; } };
    for (const raw of part.replace(/^\n/, "").split("\n")) {
      const line = escapeHtml(raw);
      let m;
      if ((m = /^(#{1,6})\s+(.*)$/.exec(line))) {
        const level = Math.min(6, m[1].length + 2);  // below the page's own headings
        flush(); endList(); out.push(`<h${level}>${inline(m[2])}</h${level}>`);
      } else if ((m = /^\s*[-*+]\s+(.*)$/.exec(line)) || (m = /^\s*\d+[.)]\s+(.*)$/.exec(line))) {
        flush();
        const kind = /^\s*\d/.test(line) ? "ol" : "ul";
        if (list !== kind) { endList(); out.push(`<${kind}>`); list = kind; }
        out.push("<li>" + inline(m[1]) + "</li>");
      } else if (line.trim() === "") {
        flush(); endList();
      } else {
        endList(); para.push(inline(line));
      }
    }
    flush(); endList();
  });
  return out.join("");
}
