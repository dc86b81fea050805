// A small, safe Markdown renderer for model replies: the text is HTML-escaped
// first, then a few constructs become markup (code fences, inline code, bold,
// italics, headings, lists, http(s) links). Nothing the model writes can become
// a tag or an attribute of its own: every character of it passes escapeHtml.
"use strict";

function escapeHtml(text) {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

// Inline constructs of one escaped line. Code spans are cut out first so that
// their content is never read as bold, italics or links.
function renderInline(escaped) {
  const spans = [];
  let text = escaped.replace(/`([^`]+)`/g, (_, code) => {
    spans.push("<code>" + code + "</code>");
    return "\u0000" + (spans.length - 1) + "\u0000";
  });
  // Links: only http(s) targets; the escaped URL cannot hold a quote, so it stays inside href.
  text = text.replace(/\[([^\]]+)\]\((https?:\/\/[^\s()]+)\)/g,
    (_, label, url) => '<a href="' + url + '" target="_blank" rel="noopener noreferrer">' + label + "</a>");
  text = text.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>").replace(/__([^_]+)__/g, "<strong>$1</strong>");
  text = text.replace(/(^|[^*\w])\*([^*\s][^*]*)\*(?!\*)/g, "$1<em>$2</em>")
    .replace(/(^|[^_\w])_([^_\s][^_]*)_(?!\w)/g, "$1<em>$2</em>");
  return text.replace(/\u0000(\d+)\u0000/g, (_, i) => spans[Number(i)]);
}

// The whole reply as HTML. An unclosed fence (a reply still streaming) runs to the end.
function renderMarkdown(source) {
  const lines = escapeHtml(source.replace(/\r\n?/g, "\n")).split("\n");
  const out = [];
  let paragraph = [];
  let list = null; // {tag: "ul"|"ol", items: []}
  const flushParagraph = () => {
    if (paragraph.length) out.push("<p>" + paragraph.map(renderInline).join("<br>") + "</p>");
    paragraph = [];
  };
  const flushList = () => {
    if (list) out.push("<" + list.tag + ">" + list.items.map((item) => "<li>" + renderInline(item) + "</li>")
      .join("") + "</" + list.tag + ">");
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+#.-]*)\s*$/);
    if (fence) {
      flushParagraph(); flushList();
      const code = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
      const language = fence[1] ? ' data-language="' + fence[1] + '"' : "";
      out.push("<pre" + language + "><code>" + code.join("\n") + "</code></pre>");
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
    const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
    if (heading) {
      flushParagraph(); flushList();
      const level = Math.min(heading[1].length + 2, 6); // h3..h6 inside a chat bubble
      out.push("<h" + level + ">" + renderInline(heading[2]) + "</h" + level + ">");
    } else if (bullet || numbered) {
      flushParagraph();
      const tag = bullet ? "ul" : "ol";
      if (list && list.tag !== tag) flushList();
      if (!list) list = {tag: tag, items: []};
      list.items.push((bullet || numbered)[1]);
    } else if (line.trim() === "") {
      flushParagraph(); flushList();
    } else {
      flushList();
      paragraph.push(line);
    }
  }
  flushParagraph(); flushList();
  return out.join("");
}

window.escapeHtml = escapeHtml;
window.renderMarkdown = renderMarkdown;
