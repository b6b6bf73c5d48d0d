// The labels page of a `choices` batch: the answers' distribution, the top label's probability, and the
// least-confident rows, filtered and exported for review.

import { api, download, failed } from "./api.js";
import { el, fill, num, svg, table } from "./dom.js";

const main = document.getElementById("main");

export function labelsPage(id) {
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
      d.input_shared ? el("p", { id: "input-shared", class: "muted" },
        "Every input below starts with ", el("q", { class: "shared", text: d.input_shared.trim() }),
        "; the input column shows the rest (open a row's input for all of it).") : null,
      table(["#", "id", "input", "answer", "top label", "p", "second label", "p"],
        d.least_confident.map((r) => el("tr", { "data-row": r.index },
          el("td", { class: "num", text: r.index + 1 }), el("td", { class: "rid", text: r.id }),
          inputCell(r, d.input_shared), el("td", { class: "answer", text: r.answer }),
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

// A row's input: what sets it apart from the other rows (past the start they all share), the whole input
// one click away and in the cell's title.
function inputCell(r, shared) {
  if (!shared) return el("td", { class: "excerpt", title: r.input, text: r.input });
  return el("td", { class: "excerpt", title: r.input },
    el("details", {}, el("summary", { class: "differs", text: "… " + (r.input_differs || "(the shared start only)") }),
      el("div", { class: "full", text: r.input })));
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
