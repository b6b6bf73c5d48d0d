// The two list pages: the team's batches and the queue's workers, redrawn as they are polled.

import { every, api } from "./api.js";
import { el, num, svg, when, duration } from "./dom.js";
import { progressBar, rates, stateBadge } from "./widgets.js";

const main = document.getElementById("main");

export function batchesPage() {
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

export function workersPage() {
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
        el("td", { text: w.worker_id }), el("td", { text: w.host }), el("td", { text: w.model + (w.loras && w.loras.length ? ` (+${w.loras.join(", ")})` : "") }),
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
