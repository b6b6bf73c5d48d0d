// The batchq console: a page per hash route (#/batches, #/batch/ID, #/labels/ID, #/workers) over the
// JSON endpoints of `producer serve` under /console/api (producer/api/console.py). The API key lives in
// sessionStorage (gone with the tab) and travels only in the Authorization header, never in a URL.

import { KEY, api, failed, newPage, onSignedOut } from "./api.js";
import { el, say } from "./dom.js";
import { batchPage } from "./batch.js";
import { labelsPage } from "./labels.js";
import { batchesPage, workersPage } from "./lists.js";
import { samples } from "./widgets.js";

const main = document.getElementById("main");

function signIn(message) {
  newPage();
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

// ---- routing ----

function route() {
  newPage();
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
onSignedOut((message) => {
  sessionStorage.removeItem(KEY);
  signIn(message);
});
window.addEventListener("hashchange", route);
route();
