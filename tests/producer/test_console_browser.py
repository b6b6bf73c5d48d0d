"""The console in a real Chromium (Debian's, driven by playwright), against a real Redis, a real worker on a
tiny random Llama and a real `producer serve` (tests/producer/console_stack.py); batches come from the CLI.

A screenshot of each page is saved under test-artifacts/console/ (gitignored); docs/console-*.png are
copies of two of them. Without Chromium the tests skip, saying how to install it.
"""

from __future__ import annotations

import shutil
import signal
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.producer.console_stack import KEY_A, KEY_B, REVIEWS, SHARED, Stack, shared_instruction_lines
from tests.worker.conftest import ROOT, wait_until

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
INSTALL = (
    "make chromium, i.e. apt-get install -y chromium chromium-driver (playwright: pip install -e .[test])"
)
ARTIFACTS = ROOT / "test-artifacts" / "console"
XSS = "<img src=x onerror=window.__xss=1>"
XSS_LABELS = [XSS, "<img src=y onerror=window.__xss=2>"]  # whichever the model answers, its text is markup
TIMEOUT_MS = 60_000

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium for the console's browser tests: {INSTALL}", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason=f"no playwright: {INSTALL}")
expect = sync_api.expect


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


class Console:
    """One browser tab on the console, recording what a test checks afterwards: every URL it requested
    and every message of its console (a CSP violation shows there)."""

    def __init__(self, browser: Any, stack: Stack) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
        self.page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        self.urls: list[str] = []
        self.messages: list[str] = []
        self.page.on("request", lambda r: self.urls.append(r.url))
        self.page.on("console", lambda m: self.messages.append(m.text))
        self.errors: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.stack = stack

    def sign_in(self, key: str, route: str = "") -> None:
        self.page.goto(self.stack.server.base + "/console" + route)
        self.page.fill("#api-key", key)
        self.page.click("#sign-in button[type=submit]")

    def shot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def close(self) -> None:
        leaked = [u for u in self.urls if KEY_A in u or KEY_B in u]
        blocked = [m for m in self.messages if "Content Security Policy" in m]
        self.context.close()
        assert leaked == [], "an API key appeared in a URL"
        assert blocked == [], f"the page did something its CSP blocks: {blocked}"
        assert self.errors == [], f"the page's script failed: {self.errors}"


@pytest.fixture
def console(browser: Any, console_stack: Stack) -> Iterator[Console]:
    c = Console(browser, console_stack)
    yield c
    c.close()


def test_a_cli_batch_appears_and_reaches_100_percent_without_a_reload(console: Console) -> None:
    console.sign_in(KEY_A)
    page = console.page
    expect(page.locator("#batches")).to_be_visible()
    page.evaluate("window.__loadedOnce = true")  # a reload would lose it
    tag = uuid.uuid4().hex[:6]
    # The worker is paused (SIGSTOP) until the page shows the batch queued: a tiny model on an idle machine
    # would otherwise finish it within one of the page's polls.
    worker = console.stack.worker.proc
    worker.send_signal(signal.SIGSTOP)
    try:
        other = console.stack.submit([{"prompt": f"{tag} other team", "max_tokens": 2}], key=KEY_B)
        bid = console.stack.submit([{"id": f"{tag}-{i}", "prompt": f"{tag} live {i}", "max_tokens": 96,
                                     "ignore_eos": True} for i in range(24)])  # fmt: skip
        row = page.locator(f'tr[data-batch="{bid}"]')
        expect(row.locator(".pct")).to_have_text("0%")
    finally:
        worker.send_signal(signal.SIGCONT)
    seen = []  # the bar's percentages as the page redraws them, until the batch is done
    while not seen or seen[-1] != "100%":
        seen.append(row.locator(".pct").text_content())
        if len(seen) == 1:
            console.shot("batches")
        page.wait_for_timeout(200)
        assert len(seen) < 300, f"not done after a minute: {seen[-5:]}"
    assert int(seen[0].rstrip("%")) < 100, "the batch was over before the page first showed it"
    expect(row.locator(".done")).to_have_text("24/24")
    assert console.stack.status(bid)["completed"] == 24
    assert page.evaluate("window.__loadedOnce") is True
    assert page.locator(f'tr[data-batch="{other}"]').count() == 0
    assert page.evaluate(f"sessionStorage.getItem('batchq.console.key') === {orjson.dumps(KEY_A).decode()}")
    assert page.evaluate("localStorage.length") == 0 and KEY_A not in page.evaluate("document.cookie")


def test_a_wrong_key_sees_nothing(console: Console) -> None:
    console.sign_in("sk-not-a-key")
    page = console.page
    expect(page.locator("#notice")).to_have_text("This API key is not accepted by the server.")
    expect(page.locator("#sign-in")).to_be_visible()
    assert page.locator("#batches").count() == 0 and page.locator("tr[data-batch]").count() == 0
    assert page.evaluate("sessionStorage.length") == 0  # the refused key is not kept
    page.goto(console.stack.server.base + "/console#/workers")  # a page's address alone shows nothing
    expect(page.locator("#sign-in")).to_be_visible()
    assert page.locator("#workers").count() == 0
    console.shot("sign-in")


def labeling_lines(tag: str) -> list[dict[str, Any]]:
    texts = ["great product", "awful, broke at once", "fine I guess", "love it", "never again", "meh",
             "works as described", "returned it", XSS, "five stars", "worst purchase", "ok"]  # fmt: skip
    out: list[dict[str, Any]] = [
        {"id": f"{tag}-{i}", "prompt": f"Review: {t}\nSentiment:", "choices": ["positive", "negative"],
         "temperature": 0}
        for i, t in enumerate(texts)
    ]  # fmt: skip
    out[11]["choices"] = XSS_LABELS
    out[3]["id"] = f"<b>{tag}</b>"  # an id is data too
    out.append({"id": f"{tag}-bad", "prompt": "x", "max_tokens": -1})  # refused at submit: a failed request
    return out


def test_the_labels_page_shows_what_the_results_hold_as_text(console: Console) -> None:
    tag = uuid.uuid4().hex[:6]
    stack = console.stack
    bid = stack.submit(labeling_lines(tag), "--skip-invalid")
    assert stack.wait(bid)["completed"] == 12
    results = [r for r in stack.results(bid) if r.get("label_scores")]
    counts = Counter(r["text"] for r in results)

    def top(r: dict[str, Any]) -> float:
        return max(s["prob"] for s in r["label_scores"])

    ids = [r["id"] for r in sorted(results, key=lambda r: (top(r), results.index(r)))]

    console.sign_in(KEY_A, f"#/batch/{bid}")
    page = console.page
    expect(page.locator("#reasons")).to_be_visible()
    expect(page.locator("#errors")).to_contain_text("invalid_request")
    expect(page.locator("#errors")).to_contain_text(f"{tag}-bad")
    expect(page.locator("#throughput")).to_be_visible()
    expect(page.locator('[data-counter="completed"] dd')).to_have_text("12")
    expect(page.locator("#tokens")).to_contain_text(str(console.stack.worker.model))  # the model that ran
    console.shot("batch")

    page.click("#labels-link")
    expect(page.locator("#least-confident tbody tr")).to_have_count(12)
    shown = {
        page.locator(f'#distribution tr[data-label="{label}"] .label').text_content(): int(
            page.locator(f'#distribution tr[data-label="{label}"] .count').text_content() or "0"
        )
        for label in counts
    }
    assert shown == dict(counts)
    assert page.locator("#distribution tbody tr").count() == len(counts)
    assert page.locator("#least-confident .rid").all_text_contents() == ids
    hist = page.locator("#histogram rect[data-bin]").count()
    assert hist == 10
    # The markup in answers, labels, ids and inputs is shown as text and runs nothing. (The CSP would block
    # the handler even if it were parsed as HTML: the img count and the CSP messages in Console.close are
    # what would see such a parse.)
    markup = next(r["text"] for r in results if r["id"] == f"{tag}-11")
    assert markup in XSS_LABELS
    expect(page.locator('#least-confident tr[data-row="11"] .answer')).to_have_text(markup)
    # Rows are numbered from 1, as the lines of a file are: the 12th result (index 11) is row 12.
    expect(page.locator('#least-confident tr[data-row="11"] td.num').first).to_have_text("12")
    assert sorted(
        int(n) for n in page.locator("#least-confident tbody tr td:first-child").all_text_contents()
    ) == (list(range(1, 13)))
    # "Review: " is all these inputs share: too little to set apart, so each row shows its whole input.
    assert (
        page.locator("#input-shared").count() == 0 and page.locator("#least-confident details").count() == 0
    )
    expect(page.locator("#distribution")).to_contain_text(markup)
    expect(page.locator("#least-confident")).to_contain_text(XSS)
    expect(page.locator("#least-confident")).to_contain_text(f"<b>{tag}</b>")
    assert page.locator("main img, main b").count() == 0
    assert page.evaluate("window.__xss") is None
    console.shot("labels")

    # Filter by answer and threshold, then export what the filter keeps.
    answer, _ = counts.most_common(1)[0]
    cut = sorted(top(r) for r in results if r["text"] == answer)[0] + 1e-9
    page.select_option("#label-filter", answer)
    page.fill("#prob-filter", f"{cut:.10f}")
    page.click("#filters button[type=submit]")
    kept = [r["id"] for r in results if r["text"] == answer and top(r) <= cut]
    expect(page.locator("#least-confident tbody tr")).to_have_count(len(kept))
    with page.expect_download() as dl:
        page.click("#export")
    rows = [orjson.loads(x) for x in Path(dl.value.path()).read_bytes().splitlines()]
    assert [r["id"] for r in rows] == page.locator("#least-confident .rid").all_text_contents()
    assert all(r["answer"] == answer and r["labels"][0]["prob"] <= cut for r in rows) and rows
    assert all("Review:" in r["input"] for r in rows)


def test_the_labels_page_says_a_shared_instruction_once_and_each_row_what_differs(console: Console) -> None:
    tag = uuid.uuid4().hex[:6]
    bid = console.stack.submit(shared_instruction_lines(tag))
    assert console.stack.wait(bid)["completed"] == len(REVIEWS)
    console.sign_in(KEY_A, f"#/labels/{bid}")
    page = console.page
    expect(page.locator("#least-confident tbody tr")).to_have_count(len(REVIEWS))
    expect(page.locator("#input-shared .shared")).to_have_text(SHARED)
    for i, text in enumerate(REVIEWS):
        row = page.locator(f'#least-confident tr[data-row="{i}"]')
        expect(row.locator("td.num").first).to_have_text(str(i + 1))  # numbered from 1, as ids here are
        expect(row.locator(".rid")).to_have_text(f"{tag}-{i + 1}")
        cell = row.locator("td.excerpt")
        expect(cell.locator("summary")).to_have_text(
            f"… {text} Sentiment:"
        )  # what differs, not the instruction
        assert SHARED not in (cell.locator("summary").text_content() or "")
        full = f"{SHARED} {text} Sentiment:"
        expect(cell).to_have_attribute("title", full)  # the whole input on hover
        expect(cell.locator(".full")).to_be_hidden()
        cell.locator("summary").click()  # and on a click
        expect(cell.locator(".full")).to_be_visible()
        expect(cell.locator(".full")).to_have_text(full)
    console.shot("labels-shared-instruction")


def test_downloads_are_the_cli_files(console: Console) -> None:
    stack = console.stack
    bid = stack.submit([{"id": f"d{i}", "prompt": f"download {i}", "max_tokens": 3} for i in range(3)])
    stack.wait(bid)
    console.sign_in(KEY_A, f"#/batch/{bid}")
    page = console.page
    with page.expect_download() as dl:
        page.click('[data-download="output-openai"]')
    assert dl.value.suggested_filename == f"{bid}_output.jsonl"
    assert Path(dl.value.path()).read_bytes() == stack.cli("results", bid, "--format", "openai").stdout
    with page.expect_download() as dl:
        page.click('[data-download="output-jsonl"]')
    assert Path(dl.value.path()).read_bytes() == stack.cli("results", bid).stdout


def test_the_workers_page_shows_the_live_worker(console: Console) -> None:
    console.sign_in(KEY_A, "#/workers")
    row = console.page.locator(f'tr[data-worker="{console.stack.worker.id}"]')
    expect(row).to_be_visible()
    expect(row).to_contain_text("cpu")
    console.shot("workers")


def test_cancel_and_retry_buttons_change_what_the_cli_reads(console: Console) -> None:
    stack = console.stack
    tag = uuid.uuid4().hex[:6]
    bid = stack.submit([{"id": f"{tag}-{i}", "prompt": f"{tag} long {i}", "max_tokens": 400, "ignore_eos": True}
                        for i in range(40)])  # fmt: skip
    console.sign_in(KEY_A, f"#/batch/{bid}")
    page = console.page
    cancel = page.locator("#cancel")
    expect(cancel).to_be_enabled()
    cancel.click()
    expect(cancel).to_have_text("Click again to cancel")
    cancel.click()
    expect(page.locator("#notice")).to_contain_text("Cancelled")
    wait_until(lambda: stack.status(bid)["state"] == "cancelled", 60, "the batch cancelled")
    st = stack.status(bid)
    assert st["cancelled"] > 0 and st["completed"] + st["cancelled"] == 40
    retry = page.locator("#retry-cancelled")
    expect(retry).to_have_text(f"Retry cancelled ({st['cancelled']})")
    expect(cancel).to_be_disabled()
    console.shot("batch-cancelled")
    retry.click()
    expect(page.locator("#notice")).to_contain_text(f"{st['cancelled']} of {st['cancelled']} selected")
    again = stack.status(bid)
    assert again["state"] in ("running", "queued") and again["cancelled"] == 0
    assert 0 < again["retrying"] <= st["cancelled"]  # until each new attempt has its result
    expect(page.locator('[data-counter="cancelled"] dd')).to_have_text("0")
    expect(page.locator("#cancel")).to_be_enabled()
    stack.cli("cancel", bid)  # leave the worker free for whoever comes next
