// specserve's chat page: streams /v1/chat/completions (fetch + ReadableStream, server-sent
// events) with `return_token_origins` and `logprobs`, and shows every token as a span colored
// by its origin, with TTFT, decode tokens/s, acceptance and a per-round chart beside the answer.
//
// Token text: the stream's `content` is the exact answer text; each token's own text comes from
// its logprobs entry. Spans are cut from the content by matching those pieces in order, so the
// page shows exactly the streamed text even where a piece does not match (a character made of
// several tokens, an end-of-sequence token): such tokens share one span.
//
// The answer is rendered as Markdown (`markdown.js`), every token span keeping its color; a
// note under it says in words when drafting was off (k = 0) for some rounds or the whole answer.
//
// Rounds, from origins alone: the answer's first token comes from the prompt's prefill, not a
// round; after it a round is its accepted drafts followed by one recovered, bonus or plain token
// (a round cut short by a stop ends with its accepted drafts). Drafts verified in a round =
// accepted + 1 if it ended with a recovered token, else accepted: the k the server chose, except
// that drafts after a rejected one are never verified and so do not show.
"use strict";

(() => {
  const ORIGINS = ["accepted", "recovered", "bonus", "plain"];
  const $ = (id) => document.getElementById(id);
  const state = { model: null, history: [], controller: null, busy: false };

  // ------------------------------------------------------------------ errors anywhere
  function showError(text) {
    const box = $("error");
    box.textContent = text;
    box.hidden = !text;
  }
  window.addEventListener("error", (e) => showError(`Page error: ${e.message}`));
  window.addEventListener("unhandledrejection", (e) =>
    showError(`Page error: ${e.reason && e.reason.message ? e.reason.message : e.reason}`));

  function setStatus(text) { $("status").textContent = text; }

  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = $("api-key").value.trim();
    if (key) h.Authorization = `Bearer ${key}`;
    return h;
  }

  // An OpenAI error body (or whatever came back) as one readable line.
  async function responseError(resp) {
    let text = "";
    try { text = await resp.text(); } catch (e) { /* the body is lost too */ }
    let detail = text.trim().slice(0, 500) || resp.statusText || "no details";
    try {
      const body = JSON.parse(text);
      if (body && body.error) detail = errorLine(body.error);
    } catch (e) { /* not JSON: keep the text */ }
    return `The server refused the request (HTTP ${resp.status}): ${detail}`;
  }

  function errorLine(error) {
    if (typeof error === "string") return error;
    let line = error.message || JSON.stringify(error);
    if (error.param) line += ` [field: ${error.param}]`;
    if (error.code) line += ` [${error.code}]`;
    return line;
  }

  function connectionError(e) {
    return "Lost the connection to the server" + (e && e.message ? ` (${e.message})` : "") +
      ". Is `specserve serve` still running?";
  }

  // ------------------------------------------------------------------ the model
  async function loadModel() {
    try {
      const resp = await fetch("v1/models", { headers: headers() });
      if (!resp.ok) {
        const why = await responseError(resp);
        $("model-name").textContent = "unknown";
        showError(resp.status === 401 ? `${why} Enter the API key under Settings → Server.` : why);
        return false;
      }
      const body = await resp.json();
      state.model = body.data[0].id;
      $("model-name").textContent = state.model;
      showError("");
      return true;
    } catch (e) {
      $("model-name").textContent = "unknown";
      showError(connectionError(e));
      return false;
    }
  }

  // ------------------------------------------------------------------ settings → body fields
  function numberField(id, label, integer) {
    const el = $(id);
    if (el.validity && el.validity.badInput) throw new Error(`${label}: not a number`);
    const raw = el.value.trim();
    if (raw === "") return undefined;
    const value = Number(raw);
    if (!Number.isFinite(value)) throw new Error(`${label}: not a number`);
    if (integer && !Number.isInteger(value)) throw new Error(`${label}: must be a whole number`);
    return value;
  }

  function requestFields() {
    const fields = {};
    const put = (name, value) => { if (value !== undefined) fields[name] = value; };
    put("temperature", numberField("temperature", "Temperature"));
    put("top_p", numberField("top-p", "Top p"));
    put("max_tokens", numberField("max-tokens", "Max tokens", true));
    put("seed", numberField("seed", "Seed", true));
    const mode = $("spec-mode").value;
    const tv = numberField("tv-budget", "TV budget");
    if (mode === "off") {
      fields.speculative = false;
    } else {
      const spec = {};
      if (mode === "fixed") spec.num_speculative_tokens = numberField("spec-k", "k", true);
      if (mode === "cost") spec.num_speculative_tokens = -1;
      if (tv !== undefined) spec.tv_budget = tv;
      if (Object.keys(spec).length) fields.speculative = spec;
    }
    return fields;
  }

  // ------------------------------------------------------------------ one answer
  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  const SVG = "http://www.w3.org/2000/svg";
  const STATS = [
    ["ttft", "TTFT (here)"], ["tps", "decode tokens/s (here)"], ["tokens", "tokens"],
    ["acceptance", "acceptance rate"], ["mal", "mean acceptance length"],
    ["meank", "mean k"], ["tv", "realised TV"], ["counts", "origins"],
  ];

  class Answer {
    constructor(log) {
      this.item = el("li", "msg assistant");
      this.item.dataset.state = "streaming";
      const body = this.row = el("div", "answer-row");
      this.text = el("div", "answer");
      this.text.setAttribute("aria-label", "answer");
      this.text.tabIndex = 0;
      const side = el("div", "stats");
      const dl = el("dl");
      this.cells = {};
      for (const [key, label] of STATS) {
        dl.append(el("dt", null, label));
        const dd = el("dd", null, "–");
        dd.dataset.stat = key;
        dl.append(dd);
        this.cells[key] = dd;
      }
      const figure = el("figure", "chart");
      this.svg = document.createElementNS(SVG, "svg");
      this.svg.setAttribute("viewBox", "0 0 240 64");
      this.svg.setAttribute("preserveAspectRatio", "none");
      this.svg.setAttribute("role", "img");
      this.caption = el("figcaption", null, "drafts verified per round");
      figure.append(this.svg, this.caption);
      side.append(dl, figure);
      body.append(this.text, side);
      this.note = el("p", "spec-note");
      this.note.hidden = true;
      this.errorBox = el("p", "msg-error");
      this.errorBox.setAttribute("role", "alert");
      this.errorBox.hidden = true;
      this.item.append(el("p", "who", "assistant"), body, this.note, this.errorBox);
      log.append(this.item);

      this.content = "";        // the exact streamed text
      this.pending = "";        // streamed text not yet in a span
      this.queue = [];          // tokens not yet in a span: {origin, piece, logprob}
      this.segments = [];       // the spans, in order: {text, origin, tokens, title, multi}
      this.counts = { accepted: 0, recovered: 0, bonus: 0, plain: 0 };
      this.numTokens = 0;
      this.seen = 0;            // tokens counted into rounds so far
      this.rounds = [];         // {accepted, rejected, end}
      this.open = 0;            // accepted drafts of the round in progress
      this.final = null;        // speculative_stats from the last chunk
      this.start = performance.now();
      this.first = null;
      this.last = null;
      this.drawPending = false;
    }

    // One choice delta: new text, one origin per new token, one logprobs entry per new token.
    add(text, origins, logprobs) {
      const now = performance.now();
      if (origins.length || text) {
        if (this.first === null) this.first = now;
        this.last = now;
      }
      origins.forEach((origin, i) => {
        const lp = logprobs[i] || {};
        this.queue.push({ origin, piece: lp.token, logprob: lp.logprob });
        this.countRound(origin);
      });
      this.numTokens += origins.length;
      this.content += text;
      this.pending += text;
      this.align(false);
      this.redraw();
    }

    countRound(origin) {
      if (this.counts[origin] !== undefined) this.counts[origin] += 1;
      this.seen += 1;
      if (this.seen === 1) return;  // the first token is the prefill's, not a round's
      if (origin === "accepted") { this.open += 1; return; }
      this.rounds.push({ accepted: this.open, rejected: origin === "recovered", end: origin });
      this.open = 0;
    }

    // Cut spans from the pending text, token by token, while pieces match it.
    align(flush) {
      const usable = (t) => typeof t.piece === "string" && t.piece !== "" && !t.piece.includes("\ufffd");
      while (this.queue.length) {
        const t = this.queue[0];
        if (usable(t) && this.pending.startsWith(t.piece)) {
          this.span([t], t.piece);
          continue;
        }
        let j = 1;
        while (j < this.queue.length && !usable(this.queue[j])) j += 1;
        const at = j < this.queue.length ? this.pending.indexOf(this.queue[j].piece) : -1;
        if (at < 0) break;  // wait for more text
        this.span(this.queue.slice(0, j), this.pending.slice(0, at));
      }
      if (flush) {
        if (this.queue.length || this.pending) this.span(this.queue.slice(), this.pending);
      }
    }

    span(tokens, text) {
      this.queue.splice(0, tokens.length);
      this.pending = this.pending.slice(text.length);
      const origin = tokens.length ? tokens[0].origin : "plain";
      this.segments.push({
        text, origin: ORIGINS.includes(origin) ? origin : "plain",
        tokens: tokens.map((t) => t.origin).join(" ") || "unknown", multi: tokens.length > 1,
        title: tokens.map((t) => t.origin + (typeof t.logprob === "number"
          ? ` (logprob ${t.logprob.toFixed(3)})` : "")).join(" + ") || "text without a token",
      });
    }

    redraw() {
      if (this.drawPending) return;
      this.drawPending = true;
      requestAnimationFrame(() => { this.drawPending = false; this.render(); });
    }

    render() {
      window.SpecserveMarkdown.render(this.text, this.segments);
      this.renderNote();
      const c = this.cells;
      const fmt = (x, d) => (x === null || x === undefined || !Number.isFinite(x) ? "–" : x.toFixed(d));
      if (this.first !== null) c.ttft.textContent = `${fmt(this.first - this.start, 0)} ms`;
      const decodeS = this.first !== null ? (this.last - this.first) / 1000 : 0;
      c.tps.textContent = this.numTokens > 1 && decodeS > 0 ? fmt((this.numTokens - 1) / decodeS, 1) : "–";
      c.tokens.textContent = String(this.numTokens);
      c.counts.replaceChildren(...ORIGINS.map((o) => el("span", `tok ${o}`, `${this.counts[o]} ${o}`)));
      const verified = this.rounds.reduce((s, r) => s + r.accepted + (r.rejected ? 1 : 0), 0) + this.open;
      const accepted = this.rounds.reduce((s, r) => s + r.accepted, 0) + this.open;
      const emitted = this.rounds.reduce((s, r) => s + r.accepted + 1, 0);
      const s = this.final;
      if (s && s.enabled !== undefined) {
        c.acceptance.textContent = s.acceptance_rate === null ? "–" : `${fmt(100 * s.acceptance_rate, 1)} %`;
        c.mal.textContent = fmt(s.mean_acceptance_length, 2);
        c.meank.textContent = s.rounds ? fmt(s.drafted / s.rounds, 2) : "–";
        c.tv.textContent = fmt(s.realised_tv, 3);
      } else {
        // while streaming: from the origins (acceptance counts verified drafts only)
        c.acceptance.textContent = verified ? `≈ ${fmt(100 * accepted / verified, 1)} %` : "–";
        c.mal.textContent = this.rounds.length ? `≈ ${fmt(emitted / this.rounds.length, 2)}` : "–";
      }
      this.renderChart();
    }

    // Drafting off, in words: for the request, for every round, or for some rounds (k = 0).
    renderNote() {
      const s = this.final;
      const off = this.rounds.filter((r) => r.accepted === 0 && r.end === "plain").length;
      const why = "the cost-aware policy expected the gain below the cost of drafting, the " +
        "drafter had nothing to propose, or the answer's last token left no room for drafts";
      const reasons = {
        no_match: "no earlier text continued this one (nothing to draft from)",
        did_not_pay: "drafting did not pay: expected gain below cost",
        batch_limit: "the batch had reached disable_by_batch_size",
        draft_starting: "the draft model was still being started",
        no_room: "no room was left for drafts", off: "speculation was off for this request",
        backed_off: "its text rarely repeated, so the lookup looked only every few rounds",
        probe: "a plain step timed now and then, to keep the price of drafting right"};
      const idle = s && s.idle_rounds ? Object.entries(s.idle_rounds) : [];
      const said = idle.map(([k, n]) => `${reasons[k] || k} (${n} round${n === 1 ? "" : "s"})`);
      const sources = s && s.by_source ? Object.entries(s.by_source).map(([name, v]) =>
        `${name.replace("_", " ")} drafted ${v.drafted} tokens in ${v.rounds} rounds, ` +
        `${v.accepted} accepted`) : [];
      let text = "";
      if (s && s.enabled === false) {
        text = "Drafting was off for this answer: speculation is disabled for this request " +
          "(Settings → Mode, or a server started without speculation).";
      } else if (this.rounds.length && off === this.rounds.length) {
        text = `Drafting was off for the whole answer (k = 0 in all ${off} rounds): ` +
          `${said.length ? said.join("; ") : why}.`;
      } else if (off) {
        text = `Drafting was off in ${off} of ${this.rounds.length} rounds (k = 0): ` +
          `${said.length ? said.join("; ") : why}.`;
      }
      if (sources.length) text = `${text} ${sources.join("; ")}.`.trim();
      this.note.textContent = text;
      this.note.hidden = !text;
    }

    renderChart() {
      const rounds = this.rounds;
      while (this.svg.firstChild) this.svg.firstChild.remove();
      const W = 240, H = 64;
      const maxK = Math.max(1, ...rounds.map((r) => r.accepted + (r.rejected ? 1 : 0)));
      const w = Math.min(12, W / Math.max(rounds.length, 1));
      const unit = (H - 4) / maxK;
      const rect = (x, y, width, height, cls, label) => {
        const r = document.createElementNS(SVG, "rect");
        r.setAttribute("x", x); r.setAttribute("y", y);
        r.setAttribute("width", width); r.setAttribute("height", height);
        r.setAttribute("class", cls);
        if (label) {
          const t = document.createElementNS(SVG, "title");
          t.textContent = label;
          r.append(t);
        }
        this.svg.append(r);
      };
      rounds.forEach((r, i) => {
        const x = i * w;
        const gap = w > 3 ? 1 : 0;
        const label = `round ${i + 1}: ${r.accepted} accepted` + (r.rejected ? ", 1 rejected" : "") + `, ended by ${r.end}`;
        if (r.accepted + (r.rejected ? 1 : 0) === 0) {
          rect(x, H - 2, w - gap, 2, "bar-plain", label);
          return;
        }
        rect(x, H - r.accepted * unit, w - gap, r.accepted * unit, "bar-accepted", label);
        if (r.rejected) rect(x, H - (r.accepted + 1) * unit, w - gap, unit, "bar-rejected", label);
      });
      const ks = rounds.map((r) => r.accepted + (r.rejected ? 1 : 0));
      this.svg.dataset.rounds = String(rounds.length);
      const text = rounds.length
        ? `drafts verified per round: ${rounds.length} rounds, ${Math.min(...ks)} to ${Math.max(...ks)}`
        : "drafts verified per round: no rounds yet";
      this.svg.setAttribute("aria-label", text);
      this.caption.textContent = text;
    }

    finish(stats) {
      if (stats) this.final = stats;
      if (this.open) {  // a round cut short by a stop: its accepted drafts only
        this.rounds.push({ accepted: this.open, rejected: false, end: "stop" });
        this.open = 0;
      }
      this.align(true);
      this.render();
      this.item.dataset.state = "done";
    }

    fail(message, stateName) {
      this.align(true);
      this.render();
      this.errorBox.textContent = message;
      this.errorBox.hidden = false;
      this.row.hidden = !this.numTokens && !this.content;  // nothing came: only the message
      this.item.dataset.state = stateName || "error";
    }
  }

  // ------------------------------------------------------------------ the conversation
  function addUser(text) {
    const hint = document.querySelector("#log .empty-hint");
    if (hint) hint.remove();
    const item = el("li", "msg user");
    item.append(el("p", "who", "you"), el("p", "bubble", text));
    $("log").append(item);
  }

  function setBusy(busy) {
    state.busy = busy;
    $("send").disabled = busy;
    $("stop").disabled = !busy;
  }

  async function send() {
    if (state.busy) return;
    const text = $("message").value;
    if (!text.trim()) { showError("Type a message first."); return; }
    let fields;
    try { fields = requestFields(); } catch (e) { showError(`Settings: ${e.message}`); return; }
    showError("");
    if (state.model === null && !(await loadModel())) return;
    const messages = [];
    const system = $("system").value;
    if (system.trim()) messages.push({ role: "system", content: system });
    messages.push(...state.history, { role: "user", content: text });
    const body = {
      model: state.model, messages, stream: true, stream_options: { include_usage: true },
      return_token_origins: true, logprobs: true, ...fields,
    };
    addUser(text);
    $("message").value = "";
    const answer = new Answer($("log"));
    answer.item.scrollIntoView({ block: "end" });
    setBusy(true);
    setStatus("generating…");
    state.controller = new AbortController();
    try {
      const ok = await stream(body, answer, state.controller.signal);
      if (ok) {
        state.history.push({ role: "user", content: text }, { role: "assistant", content: answer.content });
        setStatus(`answer done: ${answer.numTokens} tokens`);
      } else {
        setStatus("the request failed");
      }
    } finally {
      setBusy(false);
      state.controller = null;
      $("message").focus();
    }
  }

  // Sends one streaming request into `answer`; true when it ended with [DONE] and no error.
  async function stream(body, answer, signal) {
    let resp;
    try {
      resp = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(body), signal,
      });
    } catch (e) {
      answer.fail(signal.aborted ? "Stopped." : connectionError(e), signal.aborted ? "stopped" : "error");
      return false;
    }
    if (!resp.ok) {
      answer.fail(await responseError(resp));
      return false;
    }
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let done = false;
    let failed = null;
    let stats = null;
    const handle = (block) => {
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (!data) return;
      if (data === "[DONE]") { done = true; return; }
      const chunk = JSON.parse(data);
      if (chunk.error) { failed = `The server failed while answering: ${errorLine(chunk.error)}`; return; }
      for (const choice of chunk.choices || []) {
        if (choice.index !== 0) continue;
        const delta = choice.delta || {};
        const lps = choice.logprobs && choice.logprobs.content ? choice.logprobs.content : [];
        answer.add(delta.content || "", delta.origins || [], lps);
      }
      if (chunk.speculative_stats) stats = chunk.speculative_stats;
    };
    try {
      for (;;) {
        const { value, done: end } = await reader.read();
        if (end) break;
        buffer += value.replace(/\r\n/g, "\n");
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          handle(buffer.slice(0, cut));
          buffer = buffer.slice(cut + 2);
        }
      }
      if (buffer.trim()) handle(buffer);
    } catch (e) {
      if (signal.aborted) { answer.fail("Stopped.", "stopped"); return false; }
      answer.fail(e instanceof SyntaxError ? `The server sent a chunk this page cannot read: ${e.message}`
        : connectionError(e));
      return false;
    }
    if (failed) { answer.fail(failed); return false; }
    if (!done) {
      answer.fail("The answer stopped before the server finished it: the connection was lost.");
      return false;
    }
    answer.finish(stats);
    return true;
  }

  // ------------------------------------------------------------------ wiring
  function init() {
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
    $("settings").addEventListener("submit", (e) => { e.preventDefault(); send(); });
    $("message").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
    });
    document.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); send(); }
      if (e.key === "Escape" && state.controller) state.controller.abort();
    });
    $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
    $("clear").addEventListener("click", () => {
      if (state.controller) state.controller.abort();
      state.history = [];
      $("log").replaceChildren();
      showError("");
      setStatus("new chat");
      $("message").focus();
    });
    const mode = $("spec-mode");
    const syncMode = () => { $("spec-k").disabled = mode.value !== "fixed"; };
    mode.addEventListener("change", syncMode);
    syncMode();
    $("api-key").addEventListener("change", loadModel);
    loadModel();
    $("message").focus();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
