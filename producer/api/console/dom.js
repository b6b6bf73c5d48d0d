// DOM building blocks of the console. Every value from a batch, a request or a result reaches the page
// through textContent or setAttribute here, never as HTML: that is what makes the console safe with data
// that holds markup.

const SVG_NS = "http://www.w3.org/2000/svg";
const notice = document.getElementById("notice");

// replaceChildren, leaving out the parts a page does not have (null, false).
export function fill(node, ...kids) {
  node.replaceChildren(...kids.flat().filter((k) => k !== null && k !== undefined && k !== false));
}

export function el(tag, props, ...kids) {
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

export function svg(tag, attrs, ...kids) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") node.textContent = String(v);
    else node.setAttribute(k, String(v));
  }
  for (const kid of kids.flat()) if (kid) node.append(kid);
  return node;
}

export function table(headers, rows, props) {
  return el("table", props, el("thead", {}, el("tr", {}, headers.map((h) => el("th", { text: h })))),
    el("tbody", {}, rows));
}

export const num = (n) => (n === null || n === undefined ? "-" : Number(n).toLocaleString("en-US"));
export const pct = (x) => (x * 100).toFixed(1) + "%";
export const when = (t) => (t ? new Date(t * 1000).toLocaleString() : "-");

export function duration(s) {
  if (s === null || s === undefined || !isFinite(s)) return "--:--";
  s = Math.round(s);
  const two = (n) => String(n).padStart(2, "0");
  return s >= 3600 ? `${Math.floor(s / 3600)}:${two(Math.floor(s / 60) % 60)}:${two(s % 60)}`
    : `${two(Math.floor(s / 60))}:${two(s % 60)}`;
}

export const span = (s) => (s < 60 ? `${s.toFixed(1)} s` : duration(s)); // a chart's time axis

export function say(text, kind) {
  notice.textContent = text;
  notice.className = kind || "";
  notice.hidden = !text;
}
