// A batch's page: its counters and tokens (polled), its report (finish reasons, failed requests, the
// throughput chart), cancel and retry as the CLI runs them, and its files.

import { api, download, every, failed } from "./api.js";
import { el, fill, num, pct, say, span, svg, table, when, duration } from "./dom.js";
import { progressBar, rates, stateBadge } from "./widgets.js";

const main = document.getElementById("main");

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

export function batchPage(id) {
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
