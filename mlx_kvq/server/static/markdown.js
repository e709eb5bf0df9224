// Markdown from the model, rendered so that model output can never become
// markup: raw HTML is shown as text, images become links (nothing is fetched),
// links keep only http(s) and mailto targets, task-list boxes are characters,
// and DOMPurify removes anything outside an allow-list before the result
// reaches the page (the page's Content Security Policy forbids inline scripts
// on top of that).
import { Marked } from "./vendor/marked.esm.js";
import DOMPurify from "./vendor/purify.es.mjs";

const SAFE_URL = /^(?:https?:|mailto:)/i;
const ENTITIES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ENTITIES[c]);
}

function anchor(href, inner) {
  return `<a href="${escapeHtml(href)}">${inner}</a>`;
}

const marked = new Marked({
  gfm: true,
  breaks: false,
  renderer: {
    html({ text, block }) {
      const shown = escapeHtml(block ? text.replace(/\n+$/, "") : text);
      return block ? `<p class="raw">${shown}</p>\n` : shown;
    },
    image({ href, text }) {
      const label = escapeHtml(text || href);
      return SAFE_URL.test(href) ? anchor(href, label) : label;
    },
    checkbox({ checked }) {
      return checked ? "\u2611 " : "\u2610 ";
    },
    link({ href, tokens }) {
      const inner = this.parser.parseInline(tokens);
      return SAFE_URL.test(href) ? anchor(href, inner) : inner;
    },
  },
});

const PURIFY = {
  ALLOWED_TAGS: [
    "a", "p", "br", "hr", "strong", "em", "del", "code", "pre", "blockquote",
    "ul", "ol", "li", "h1", "h2", "h3", "h4", "h5", "h6",
    "table", "thead", "tbody", "tr", "th", "td",
  ],
  ALLOWED_ATTR: ["href", "title", "class", "start", "align"],
  ALLOWED_URI_REGEXP: SAFE_URL,
};

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

/** Sanitized HTML for `text` (Markdown). */
export function renderMarkdown(text) {
  return DOMPurify.sanitize(marked.parse(text || ""), PURIFY);
}

/** Show `text` (Markdown) inside `element`. */
export function setMarkdown(element, text) {
  element.innerHTML = renderMarkdown(text);
}
