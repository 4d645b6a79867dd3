// The answer's Markdown, rendered without losing a token: paragraphs, bullet and numbered
// lists, headings, fenced code blocks (monospace <pre><code>), inline `code` and **bold**.
//
// Input: the answer as segments {text, origin, tokens, title} in order (one per token span of
// app.js; several tokens may share one). Every character of the text lands in the output
// exactly once, inside the element its block gives it, or, for Markdown syntax (fences, list
// markers, ** and `), in a hidden `.md-mark` span: so the answer's textContent stays the exact
// streamed text. Each segment keeps its origin color: its first character's piece is a
// `span.tok.<origin>` carrying data-origin and the title; pieces cut off by a block boundary
// are `span.tok-cont.<origin>`. A segment with no text is a `span.tok` of its own.
//
// The whole answer is parsed again on each render (once per animation frame while it
// streams), so an unclosed fence or list simply renders as far as the text goes.
"use strict";

(() => {
  const FENCE = /^\s*(```+|~~~+)\s*([\w+.#-]*)\s*$/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])(\s+)/;
  const HEADING = /^(#{1,6})(\s+)/;

  function node(tag, cls) {
    const n = document.createElement(tag);
    if (cls) n.className = cls;
    return n;
  }

  // Lines with their offsets: [{start, end, text}] where text excludes the "\n" at `end`.
  function lines(text) {
    const out = [];
    let start = 0;
    while (start < text.length) {
      const nl = text.indexOf("\n", start);
      const end = nl < 0 ? text.length : nl;
      out.push({ start, end, text: text.slice(start, end), newline: nl >= 0 });
      start = end + 1;
    }
    return out;
  }

  // Blocks: [{tag, lang?, list?, runs: [{start, end, hidden, wrap}]}] over the text's offsets.
  function blocks(text) {
    const out = [];
    let cur = null;    // the block lines are joining
    let fence = null;  // the open fence's marker, inside a code block
    const hide = (b, start, end) => { if (end > start) b.runs.push({ start, end, hidden: true }); };
    const show = (b, start, end, inline) => {
      if (end > start) b.runs.push(...(inline ? inlineRuns(text, start, end) : [{ start, end }]));
    };
    const open = (tag, extra) => { cur = { tag, runs: [], ...extra }; out.push(cur); return cur; };
    for (const line of lines(text)) {
      const nlEnd = line.end + (line.newline ? 1 : 0);
      const f = line.text.match(FENCE);
      if (fence !== null) {
        if (f && f[1][0] === fence[0] && f[1].length >= fence.length) {
          hide(cur, line.start, nlEnd);
          fence = null;
          cur = null;
        } else {
          show(cur, line.start, nlEnd, false);
        }
        continue;
      }
      if (f) {
        fence = f[1];
        hide(open("pre", { lang: f[2] }), line.start, nlEnd);
        continue;
      }
      if (!line.text.trim()) {
        hide(cur || open("gap"), line.start, nlEnd);
        cur = null;
        continue;
      }
      const item = line.text.match(ITEM);
      const heading = line.text.match(HEADING);
      if (item) {
        const list = /\d/.test(item[2]) ? "ol" : "ul";
        const marker = line.start + item[0].length;
        open("li", { list });
        hide(cur, line.start, marker);
        show(cur, marker, line.end, true);
        hide(cur, line.end, nlEnd);
      } else if (heading) {
        open(`h${Math.min(6, heading[1].length + 2)}`);
        hide(cur, line.start, line.start + heading[0].length);
        show(cur, line.start + heading[0].length, line.end, true);
        hide(cur, line.end, nlEnd);
        cur = null;
      } else {
        if (!cur || (cur.tag !== "p" && cur.tag !== "li")) open("p");
        show(cur, line.start, nlEnd, true);  // a soft line break stays visible
      }
    }
    return out;
  }

  // Inline `code` and **bold** within [start, end): their markers hidden, their text wrapped.
  function inlineRuns(text, start, end) {
    const runs = [];
    const re = /(`+)([^`]+?)\1|\*\*([^*\n]+?)\*\*/g;
    const part = text.slice(start, end);
    let at = 0;
    for (let m; (m = re.exec(part)) !== null;) {
      const s = start + m.index;
      const mark = m[1] ? m[1].length : 2;
      const inner = m[1] ? m[2] : m[3];
      if (m.index > at) runs.push({ start: start + at, end: s });
      runs.push({ start: s, end: s + mark, hidden: true });
      runs.push({ start: s + mark, end: s + mark + inner.length, wrap: m[1] ? "code" : "strong" });
      runs.push({ start: s + mark + inner.length, end: s + m[0].length, hidden: true });
      at = m.index + m[0].length;
    }
    if (at < part.length) runs.push({ start: start + at, end });
    return runs;
  }

  // The token pieces of [start, end) into `into`; `segs` carry their start offsets, `cur.i`
  // is the first segment not yet wholly placed (ranges come in increasing order).
  function pieces(into, segs, start, end, cur) {
    for (let i = cur.i; i < segs.length; i++) {
      const s = segs[i], stop = s.start + s.text.length;
      if (s.start >= end) break;
      const a = Math.max(start, s.start), b = Math.min(end, stop);
      if (b > a || (s.text === "" && s.start >= start)) {
        const head = a === s.start;
        const span = node("span", `${head ? "tok" : "tok-cont"} ${s.origin}`);
        span.textContent = s.text.slice(a - s.start, b - s.start);
        if (head) {
          span.dataset.origin = s.tokens;
          span.title = s.title;
          if (s.multi) span.classList.add("multi");
        }
        into.append(span);
      }
      if (stop <= end) cur.i = i + 1;
    }
  }

  // Renders `segments` into `root` (replacing what it held).
  function render(root, segments) {
    let offset = 0;
    const segs = segments.map((s) => { const out = { ...s, start: offset }; offset += s.text.length; return out; });
    const text = segs.map((s) => s.text).join("");
    const frag = document.createDocumentFragment();
    let list = null;
    let last = frag;
    const cur = { i: 0 };
    for (const b of blocks(text)) {
      let el;
      if (b.tag === "li") {
        if (!list || list.tagName.toLowerCase() !== b.list) { list = node(b.list, "md"); frag.append(list); }
        el = node("li");
        list.append(el);
      } else {
        list = null;
        el = b.tag === "gap" ? node("span", "md-mark") : node(b.tag, "md");
        frag.append(el);
      }
      let into = el;
      if (b.tag === "pre") {
        into = node("code");
        if (b.lang) into.dataset.lang = b.lang;
        el.append(into);
      }
      for (const r of b.runs) {
        let target = into;
        if (r.hidden) target = node("span", "md-mark");
        else if (r.wrap) target = node(r.wrap);
        if (target !== into) into.append(target);
        pieces(target, segs, r.start, r.end, cur);
      }
      last = into;
    }
    pieces(last, segs, text.length, text.length + 1, cur);  // tokens with no text at the end
    root.replaceChildren(frag);
  }

  window.SpecserveMarkdown = { render, blocks };
})();
