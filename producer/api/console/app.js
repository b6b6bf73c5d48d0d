// The batchq console: a page per hash route (#/batches, #/batch/ID, #/labels/ID, #/workers) over the
// JSON endpoints of `producer serve` under /console/api (producer/api/console.py).
//
// Safe by construction: every value from a batch, a request or a result reaches the page through
// textContent or an attribute set by setAttribute (el() and svg() below), never as HTML. The API key lives
// in sessionStorage (gone with the tab) and travels only in the Authorization header, never in a URL.
"use strict";

(() => {
  const KEY = "batchq.console.key";
  const main = document.getElementById("main");
  const notice = document.getElementById("notice");
  const SVG_NS = "http://www.w3.org/2000/svg";
  const SEGMENTS = ["completed", "failed", "cancelled", "running", "queued"]; // `producer status`'s partition
  let generation = 0; // bumped on every page change: a stale page's polling loop stops

  class AuthError extends Error {}

  // ---- building blocks ----

  // replaceChildren, leaving out the parts a page does not have (null, false).
  function fill(node, ...kids) {
    node.replaceChildren(...kids.flat().filter((k) => k !== null && k !== undefined && k !== false));
  }

  function el(tag, props, ...kids) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "text") node.textContent = String(v);
      else if (k === "class") node.className = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, String(v));
    }
    for (const kid of kids.flat()) {
      if (kid !== null && kid !== undefined && kid !== false) node.append(kid); // a string becomes a text node
    }
    return node;
  }

  function svg(tag, attrs, ...kids) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") node.textContent = String(v);
      else node.setAttribute(k, String(v));
    }
    for (const kid of kids.flat()) if (kid) node.append(kid);
    return node;
  }

  function table(headers, rows, props) {
    return el("table", props, el("thead", {}, el("tr", {}, headers.map((h) => el("th", { text: h })))),
      el("tbody", {}, rows));
  }

  const num = (n) => (n === null || n === undefined ? "-" : Number(n).toLocaleString("en-US"));
  const pct = (x) => (x * 100).toFixed(1) + "%";
  const when = (t) => (t ? new Date(t * 1000).toLocaleString() : "-");

  function duration(s) {
    if (s === null || s === undefined || !isFinite(s)) return "--:--";
    s = Math.round(s);
    const two = (n) => String(n).padStart(2, "0");
    return s >= 3600 ? `${Math.floor(s / 3600)}:${two(Math.floor(s / 60) % 60)}:${two(s % 60)}`
      : `${two(Math.floor(s / 60))}:${two(s % 60)}`;
  }

  const span = (s) => (s < 60 ? `${s.toFixed(1)} s` : duration(s)); // a chart's time axis

  function say(text, kind) {
    notice.textContent = text;
    notice.className = kind || "";
    notice.hidden = !text;
  }

  async function api(path, opts = {}) {
    const key = sessionStorage.getItem(KEY) || "";
    const headers = Object.assign({ Authorization: "Bearer " + key }, opts.headers || {});
    const r = await fetch(path, Object.assign({ cache: "no-store" }, opts, { headers }));
    if (r.status === 401) throw new AuthError("This API key is not accepted by the server.");
    if (!r.ok) {
      let message = `${r.status} ${r.statusText}`;
      try { message = (await r.json()).error.message; } catch (_) { /* not an API error body */ }
      const e = new Error(message);
      e.status = r.status;
      throw e;
    }
    return opts.raw ? r : r.json();
  }

  async function download(path, filename) {
    const blob = await (await api(path, { raw: true })).blob();
    const url = URL.createObjectURL(blob);
    const a = el("a", { href: url, download: filename });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 30000);
  }

  function failed(e) {
    if (e instanceof AuthError) {
      sessionStorage.removeItem(KEY);
      signIn(e.message);
    } else {
      say(e.message, "error");
    }
  }

  // Runs fn now and every ms until the page changes (or fn returns false).
  function every(ms, fn) {
    const gen = generation;
    const tick = async () => {
      if (gen !== generation) return;
      let again = true;
      try { again = (await fn()) !== false; } catch (e) { failed(e); again = !(e instanceof AuthError); }
      if (again && gen === generation) setTimeout(tick, ms);
    };
    tick();
  }

  // ---- rates: tok/s and ETA from the counters sampled while polling, over the last 30 s ----

  const samples = new Map();

  function rates(row) {
    if (row.finished_at) {
      const span = Math.max(row.finished_at - row.created_at, 1e-3);
      return { tokS: row.tokens_generated / span, eta: 0 };
    }
    let q = samples.get(row.id) || [];
    const last = q[q.length - 1];
    if (last && (row.done < last.done || row.tokens_generated < last.tok)) q = []; // a retry took results back
    if (!last || last.t !== row.now) q.push({ t: row.now, done: row.done, tok: row.tokens_generated });
    while (q.length > 2 && row.now - q[0].t > 30) q.shift();
    samples.set(row.id, q);
    let [t0, done0, tok0] = [q[0].t, q[0].done, q[0].tok];
    if (row.now - t0 < 1) [t0, done0, tok0] = [row.created_at, 0, 0];
    const span = Math.max(row.now - t0, 1e-3);
    const reqS = (row.done - done0) / span;
    return { tokS: Math.max(0, (row.tokens_generated - tok0) / span),
      eta: reqS > 0 ? (row.total - row.done) / reqS : null };
  }

  function progressBar(row, width) {
    const total = Math.max(row.total, 1);
    const bar = svg("svg", { class: "bar", width, height: 14, viewBox: `0 0 ${width} 14`, role: "img" });
    let x = 0;
    for (const name of SEGMENTS) {
      const w = (row[name] / total) * width;
      if (w > 0) {
        bar.append(svg("rect", { class: "seg-" + name, x, y: 0, width: w, height: 14 },
          svg("title", { text: `${name} ${row[name]}` })));
      }
      x += w;
    }
    const percent = row.total ? Math.floor((100 * row.done) / row.total) : 100;
    return el("span", { class: "progress" }, bar, el("span", { class: "pct", text: percent + "%" }));
  }

  function stateBadge(state) {
    return el("span", { class: "state state-" + state, text: state });
  }

  // ---- pages ----

  function signIn(message) {
    generation += 1;
    document.getElementById("nav").hidden = true;
    say(message || "", message ? "error" : "");
    const input = el("input", { type: "password", id: "api-key", name: "key", autocomplete: "off",
      placeholder: "sk-...", required: "required" });
    const form = el("form", { id: "sign-in", class: "card" },
      el("h1", { text: "Sign in" }),
      el("p", { text: "Use one of the API keys this server accepts ($BATCHQ_API_KEYS or --api-keys-file). " +
        "It stays in this tab's session storage and is sent only as the bearer token." }),
      el("label", { for: "api-key", text: "API key" }), input,
      el("button", { type: "submit", text: "Sign in" }));
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      sessionStorage.setItem(KEY, input.value.trim());
      try {
        await api("/console/api/batches");
      } catch (e) {
        failed(e);
        return;
      }
      route(); // the page the address asks for (the batches by default)
    });
    main.replaceChildren(form);
    input.focus();
  }

  function batchesPage() {
    const body = el("tbody");
    const empty = el("p", { class: "muted", text: "Loading…" });
    main.replaceChildren(el("h1", { text: "Batches" }), empty,
      el("table", { id: "batches" }, el("thead", {}, el("tr", {},
        ["Batch", "State", "Progress", "Done", "Failed", "tok/s", "ETA", "Created", "Finished"]
          .map((h) => el("th", { text: h })))), body));
    every(1000, async () => {
      const data = await api("/console/api/batches");
      document.getElementById("queue").textContent = "queue " + data.queue;
      empty.textContent = data.batches.length ? "" : "No batches of this key's team on this queue yet.";
      body.replaceChildren(...data.batches.map((b) => {
        const r = rates(b);
        return el("tr", { "data-batch": b.id },
          el("td", {}, el("a", { href: "#/batch/" + encodeURIComponent(b.id), text: b.id })),
          el("td", {}, stateBadge(b.state)),
          el("td", {}, progressBar(b, 160)),
          el("td", { class: "num done", text: `${num(b.done)}/${num(b.total)}` }),
          el("td", { class: "num", text: num(b.failed) }),
          el("td", { class: "num", text: num(Math.round(r.tokS)) }),
          el("td", { class: "num", text: r.eta === 0 ? "done" : duration(r.eta) }),
          el("td", { text: when(b.created_at) }),
          el("td", { text: when(b.finished_at) }));
      }));
    });
  }

  function counters(b) {
    const items = [["total", b.total], ["queued", b.queued], ["running", b.running],
      ["completed", b.completed], ["failed", b.failed], ["cancelled", b.cancelled],
      ["timed out", b.timed_out], ["cut at max tokens", b.length], ["retrying", b.retrying],
      ["from result cache", b.from_result_cache]];
    return el("dl", { class: "counters", id: "counters" },
      items.map(([k, v]) => el("div", { "data-counter": k }, el("dt", { text: k }), el("dd", { text: num(v) }))));
  }

  function tokens(b, model) {
    const r = rates(b);
    const cached = b.prompt_tokens ? b.cached_prompt_tokens / b.prompt_tokens : 0;
    const items = [["prompt tokens", num(b.prompt_tokens)], ["completion tokens", num(b.completion_tokens)],
      ["cached prompt share", pct(cached)], ["tok/s", num(Math.round(r.tokS))],
      ["ETA", r.eta === 0 ? "done" : duration(r.eta)], ["model", b.model || model || "-"],
      ["created", when(b.created_at)], ["finished", when(b.finished_at)]];
    return el("dl", { class: "counters", id: "tokens" },
      items.map(([k, v]) => el("div", {}, el("dt", { text: k }), el("dd", { text: v }))));
  }

  function chart(tp) {
    const W = 640, H = 160, P = 36;
    if (!tp.tok_s.length) return el("p", { class: "muted", text: "No finished request to chart yet." });
    const max = Math.max(...tp.tok_s, 1);
    const w = (W - P) / tp.tok_s.length;
    const g = svg("svg", { id: "throughput", class: "chart", width: W, height: H + 24,
      viewBox: `0 0 ${W} ${H + 24}`, role: "img" }, svg("title", { text: "completion tokens per second" }));
    tp.tok_s.forEach((v, i) => {
      const h = (v / max) * (H - 8);
      g.append(svg("rect", { class: "col", x: P + i * w, y: H - h, width: Math.max(w - 1, 1), height: h },
        svg("title", { text: `${duration(i * tp.bin_s)}: ${Math.round(v)} tok/s` })));
    });
    g.append(svg("line", { class: "axis", x1: P, y1: H, x2: W, y2: H }),
      svg("text", { x: 0, y: 12, text: Math.round(max) }),
      svg("text", { x: 0, y: H, text: "0" }),
      svg("text", { x: P, y: H + 18, text: "00:00" }),
      svg("text", { x: W - 48, y: H + 18, text: span(tp.bin_s * tp.tok_s.length) }));
    return g;
  }

  function batchPage(id) {
    const path = "/console/api/batches/" + encodeURIComponent(id);
    const head = el("div", { class: "head" });
    const links = el("p", { class: "links" });
    const actions = el("div", { class: "actions" });
    const summary = el("section");
    const report = el("section");
    main.replaceChildren(head, links, actions, summary, report);
    let last = null;
    let ranOn = null; // the model that answered, from the report (a CLI batch may name none)
    let reportedDone = false;
    let reportAt = 0;

    async function act(what, body) {
      try {
        const out = await api(`${path}/${what}`, { method: "POST", body: JSON.stringify(body || {}),
          headers: { "Content-Type": "application/json" } });
        say(what === "cancel" ? `Cancelled: ${num(out.cancelled_queued ?? 0)} queued requests; ` +
          `${num(out.running)} running stop at their next step.`
          : `${num(out.enqueued)} of ${num(out.selected)} selected requests re-enqueued; ` +
          `${num(out.in_flight)} already being retried, ${num(out.not_retryable)} not retryable.`, "ok");
        reportedDone = false;
      } catch (e) { failed(e); }
    }

    function buttons(b) {
      const finished = b.done >= b.total;
      const cancel = el("button", { type: "button", id: "cancel", class: "danger", disabled: finished,
        text: "Cancel batch" });
      cancel.addEventListener("click", () => {
        if (cancel.dataset.armed) { cancel.disabled = true; act("cancel"); return; }
        cancel.dataset.armed = "1"; // a second click confirms: no dialog to dismiss by accident
        cancel.textContent = "Click again to cancel";
        setTimeout(() => { delete cancel.dataset.armed; cancel.textContent = "Cancel batch"; }, 5000);
      });
      const retry = (flag, label, n) => el("button", { type: "button", id: "retry-" + flag, disabled: !n,
        text: `Retry ${label} (${num(n)})`, onclick: () => act("retry", { [flag]: true }) });
      actions.replaceChildren(cancel, retry("failed", "failed", b.failed), retry("cancelled", "cancelled", b.cancelled),
        retry("timed_out", "timed-out", b.timed_out));
    }

    function downloads() {
      const files = [["output", "openai", "Output file (OpenAI)"], ["errors", "openai", "Error file (OpenAI)"],
        ["output", "jsonl", "Results (batchq JSONL)"], ["errors", "jsonl", "Errors (batchq JSONL)"]];
      return el("div", { class: "downloads" }, el("h2", { text: "Downloads" }),
        files.map(([file, format, label]) => el("button", { type: "button", class: "link",
          "data-download": `${file}-${format}`, text: label,
          onclick: () => download(`${path}/download?file=${file}&format=${format}`,
            `${id}_${file}${format === "jsonl" ? "_batchq" : ""}.jsonl`).catch(failed) })));
    }

    async function loadReport(b) {
      const r = await api(path + "/report");
      ranOn = r.model;
      const reasons = Object.entries(r.finish_reasons);
      fill(report,
        el("h2", { text: "Throughput (completion tokens per second)" }), chart(r.throughput),
        r.throughput.untimed ? el("p", { class: "muted",
          text: `${num(r.throughput.untimed)} results not charted (answered from the result cache, or retried).` }) : null,
        el("h2", { text: "Finish reasons" }),
        table(["reason", "requests"], reasons.map(([k, v]) =>
          el("tr", { "data-reason": k }, el("td", { text: k }), el("td", { class: "num", text: num(v) }))),
        { id: "reasons" }),
        el("h2", { text: `Failed requests (${num(r.failed)})` }),
        r.failed ? table(["id", "error type", "message"], r.errors.map((e) =>
          el("tr", {}, el("td", { text: e.id }), el("td", { text: e.type }), el("td", { text: e.message }))),
        { id: "errors" }) : el("p", { class: "muted", text: "None." }),
        r.errors_shown < r.failed ? el("p", { class: "muted",
          text: `First ${num(r.errors_shown)} shown; the error file has them all.` }) : null,
        downloads());
      links.replaceChildren(r.has_labels ? el("a", { id: "labels-link", href: "#/labels/" + encodeURIComponent(id),
        text: "Labels →" }) : "");
      reportedDone = b.done >= b.total;
    }

    every(1000, async () => {
      const b = await api(path);
      fill(head, el("h1", {}, "Batch ", el("span", { class: "id", text: b.id }), " ", stateBadge(b.state)),
        b.api ? el("p", { class: "muted", text: `OpenAI batch: ${b.api.status} (${b.api.endpoint})` }) : null);
      if (!last || last.done !== b.done || last.failed !== b.failed || last.cancelled !== b.cancelled ||
          last.timed_out !== b.timed_out) buttons(b);
      const now = Date.now();
      if (!reportedDone && (b.done >= b.total || now - reportAt > 3000)) {
        reportAt = now;
        await loadReport(b); // first: it names the model the summary shows
      }
      summary.replaceChildren(progressBar(b, 480), counters(b), tokens(b, ranOn));
      last = b;
    });
  }

  function labelsPage(id) {
    const path = "/console/api/batches/" + encodeURIComponent(id);
    const select = el("select", { id: "label-filter" }, el("option", { value: "", text: "all labels" }));
    const maxProb = el("input", { id: "prob-filter", type: "number", min: 0, max: 1, step: "any",
      placeholder: "1.00" });
    const apply = el("button", { type: "submit", text: "Apply" });
    const exportBtn = el("button", { type: "button", id: "export", text: "Export JSONL" });
    const filters = el("form", { id: "filters", class: "filters" },
      el("label", { for: "label-filter", text: "answer" }), select,
      el("label", { for: "prob-filter", text: "top probability ≤" }), maxProb, apply, exportBtn);
    const overview = el("section", { id: "overview" });
    const rows = el("section");
    main.replaceChildren(el("h1", {}, "Labels of ", el("a", { href: "#/batch/" + encodeURIComponent(id),
      class: "id", text: id })), overview, filters, rows);
    const query = () => {
      const q = new URLSearchParams();
      if (select.value) q.set("label", select.value);
      if (maxProb.value !== "") q.set("max_prob", maxProb.value);
      return q.toString() ? "?" + q.toString() : "";
    };
    let first = true;

    async function load() {
      const d = await api(path + "/labels" + query());
      if (first) {
        first = false;
        for (const { label } of d.distribution) select.append(el("option", { value: label, text: label }));
        overview.replaceChildren(distribution(d), histogram(d.histogram));
      }
      fill(rows, el("h2", { text: `Least confident rows (${num(d.matching)} match)` }),
        table(["#", "id", "input", "answer", "top label", "p", "second label", "p"],
          d.least_confident.map((r) => el("tr", { "data-row": r.index },
            el("td", { class: "num", text: r.index }), el("td", { class: "rid", text: r.id }),
            el("td", { class: "excerpt", text: r.input }), el("td", { class: "answer", text: r.answer }),
            el("td", { text: r.labels[0].label }), el("td", { class: "num prob", text: r.labels[0].prob.toFixed(3) }),
            el("td", { text: r.labels[1] ? r.labels[1].label : "-" }),
            el("td", { class: "num", text: r.labels[1] ? r.labels[1].prob.toFixed(3) : "-" }))),
          { id: "least-confident" }),
        d.matching > d.least_confident.length ? el("p", { class: "muted",
          text: `First ${num(d.least_confident.length)} shown; the export has all ${num(d.matching)}.` }) : null);
    }

    filters.addEventListener("submit", (ev) => { ev.preventDefault(); load().catch(failed); });
    exportBtn.addEventListener("click", () => download(path + "/labels.jsonl" + query(), `${id}_review.jsonl`)
      .catch(failed));
    load().catch(failed);
  }

  function distribution(d) {
    const max = Math.max(...d.distribution.map((x) => x.count), 1);
    return el("div", { class: "two" },
      el("div", {}, el("h2", { text: `Answers (${num(d.rows)} rows)` }),
        table(["label", "rows", ""], d.distribution.map((x) => el("tr", { "data-label": x.label },
          el("td", { class: "label", text: x.label }), el("td", { class: "num count", text: num(x.count) }),
          el("td", {}, svg("svg", { width: 160, height: 12, class: "bar" },
            svg("rect", { class: "seg-completed", x: 0, y: 0, width: (x.count / max) * 160, height: 12 }))))),
        { id: "distribution" })));
  }

  function histogram(hist) {
    const W = 400, H = 140, w = W / hist.length;
    const max = Math.max(...hist, 1);
    const g = svg("svg", { id: "histogram", class: "chart", width: W, height: H + 20, viewBox: `0 0 ${W} ${H + 20}`,
      role: "img" }, svg("title", { text: "rows by the top label's probability" }));
    hist.forEach((n, i) => {
      const h = (n / max) * (H - 16);
      g.append(svg("rect", { class: "col", x: i * w + 1, y: H - h, width: w - 2, height: h, "data-bin": i },
        svg("title", { text: `${(i / 10).toFixed(1)}–${((i + 1) / 10).toFixed(1)}: ${n} rows` })),
      svg("text", { x: i * w + w / 2 - 6, y: H - h - 3, text: n }),
      svg("text", { x: i * w + 2, y: H + 14, text: (i / 10).toFixed(1) }));
    });
    return el("div", {}, el("h2", { text: "Top label probability" }), g);
  }

  function workersPage() {
    const body = el("tbody");
    const empty = el("p", { class: "muted" });
    main.replaceChildren(el("h1", { text: "Workers" }), empty,
      el("table", { id: "workers" }, el("thead", {}, el("tr", {},
        ["Worker", "Host", "Model", "Device", "KV use", "Running", "Waiting", "tok/s", "Heartbeat", "Status"]
          .map((h) => el("th", { text: h })))), body));
    every(2000, async () => {
      const d = await api("/console/api/workers");
      document.getElementById("queue").textContent = "queue " + d.queue;
      empty.textContent = d.workers.length ? "" : `No live worker serves queue ${d.queue}.`;
      body.replaceChildren(...d.workers.map((w) => {
        const stalled = w.progress_age_s > w.stall_s && w.running + w.waiting > 0;
        return el("tr", { "data-worker": w.worker_id },
          el("td", { text: w.worker_id }), el("td", { text: w.host }), el("td", { text: w.model }),
          el("td", { text: `${w.device} ${w.dtype}` }),
          el("td", {}, svg("svg", { width: 80, height: 12, class: "bar" },
            svg("rect", { class: "seg-running", x: 0, y: 0, width: (w.kv_pct / 100) * 80, height: 12 })),
          ` ${w.kv_pct.toFixed(1)}%`),
          el("td", { class: "num", text: num(w.running) }), el("td", { class: "num", text: num(w.waiting) }),
          el("td", { class: "num", text: num(Math.round(w.tok_s)) }),
          el("td", { text: `${w.heartbeat_age_s.toFixed(1)} s ago` }),
          el("td", {}, stateBadge(stalled ? "stalled" : "live")));
      }));
    });
  }

  // ---- routing ----

  function route() {
    generation += 1;
    say("");
    if (!sessionStorage.getItem(KEY)) { signIn(); return; }
    document.getElementById("nav").hidden = false;
    const [page, arg] = location.hash.replace(/^#\/?/, "").split("/");
    const id = arg ? decodeURIComponent(arg) : "";
    if (page === "batch" && id) batchPage(id);
    else if (page === "labels" && id) labelsPage(id);
    else if (page === "workers") workersPage();
    else batchesPage();
  }

  document.getElementById("sign-out").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    samples.clear();
    signIn();
  });
  window.addEventListener("hashchange", route);
  route();
})();
