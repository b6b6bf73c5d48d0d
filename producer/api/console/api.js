// The console's calls of /console/api: the key from sessionStorage as the bearer token (never in a URL),
// downloads through a Blob (so they carry the header too), and the polling loop of a page.

import { el, say } from "./dom.js";

export const KEY = "batchq.console.key";
let generation = 0; // bumped on every page change: a stale page's polling loop stops
let signedOut = () => {}; // what a refused key leads to (app.js: the sign-in form)

export class AuthError extends Error {}

export function onSignedOut(fn) { signedOut = fn; }

export function newPage() { generation += 1; }

export async function api(path, opts = {}) {
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

export async function download(path, filename) {
  const blob = await (await api(path, { raw: true })).blob();
  const url = URL.createObjectURL(blob);
  const a = el("a", { href: url, download: filename });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 30000);
}

export function failed(e) {
  if (e instanceof AuthError) {
    signedOut(e.message);
  } else {
    say(e.message, "error");
  }
}

// Runs fn now and every ms until the page changes (or fn returns false).
export function every(ms, fn) {
  const gen = generation;
  const tick = async () => {
    if (gen !== generation) return;
    let again = true;
    try { again = (await fn()) !== false; } catch (e) { failed(e); again = !(e instanceof AuthError); }
    if (again && gen === generation) setTimeout(tick, ms);
  };
  tick();
}
