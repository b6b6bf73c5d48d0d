// What several pages draw: a batch's progress bar (the partition of `producer status`), its state, and
// its tok/s and ETA from the counters sampled while polling.

import { el, svg } from "./dom.js";

const SEGMENTS = ["completed", "failed", "cancelled", "running", "queued"]; // `producer status`'s partition

// ---- rates: tok/s and ETA from the counters sampled while polling, over the last 30 s ----

export const samples = new Map();

export function rates(row) {
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

export function progressBar(row, width) {
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

export function stateBadge(state) {
  return el("span", { class: "state state-" + state, text: state });
}
