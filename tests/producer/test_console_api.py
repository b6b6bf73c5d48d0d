"""The console's endpoints over HTTP, without a browser: the page and its headers, the keys, and team
isolation exactly as the /v1 API enforces it (tests/producer/console_stack.py: real Redis, worker, server)."""

from __future__ import annotations

import time
import urllib.request
import uuid

import orjson
import pytest

from tests.producer.console_stack import KEY_A, KEY_B, REVIEWS, SHARED, Stack, shared_instruction_lines

pytestmark = pytest.mark.slow

CSP = "default-src 'self'; script-src 'self'; object-src 'none'; frame-ancestors 'none'"


def lines(n: int, tag: str, **params: object) -> list[dict[str, object]]:
    return [{"id": f"{tag}-{i}", "prompt": f"{tag} prompt {i}", "max_tokens": 4, **params} for i in range(n)]


def test_the_page_is_served_at_root_and_console_under_the_csp(console_stack: Stack) -> None:
    for path in ("/", "/console"):
        status, body, headers = console_stack.get(path, None)
        assert status == 200 and headers["content-type"].startswith("text/html")
        assert headers["content-security-policy"] == CSP
        assert b"<script>" not in body and b"style=" not in body
    assert b'<script type="module" src="/console/app.js">' in body
    for name in ("app.js", "api.js", "dom.js", "widgets.js", "lists.js", "batch.js", "labels.js"):
        status, js, headers = console_stack.get(f"/console/{name}", None)
        assert status == 200 and headers["content-type"].startswith("text/javascript"), name
        for sink in (
            b"innerHTML",
            b"outerHTML",
            b"insertAdjacentHTML",
            b"document.write",
            b"eval(",
            b"Function(",
        ):
            assert sink not in js, (name, sink)  # markup never reaches the page as HTML
    assert console_stack.get("/console/../console.py", None)[0] == 404
    status, _, headers = console_stack.get("/console/api/batches", KEY_A)
    assert (
        status == 200 and headers["content-security-policy"] == CSP and headers["cache-control"] == "no-store"
    )


def test_console_endpoints_refuse_a_missing_or_wrong_key_as_the_api_does(console_stack: Stack) -> None:
    bid = console_stack.submit(lines(2, "auth"))
    paths = ["/console/api/batches", f"/console/api/batches/{bid}", f"/console/api/batches/{bid}/report",
             f"/console/api/batches/{bid}/labels", f"/console/api/batches/{bid}/download", "/console/api/workers",
             "/v1/batches"]  # fmt: skip
    for path in paths:
        for key in (None, "sk-wrong", KEY_A + "x"):
            status, body, headers = console_stack.get(path, key)
            assert status == 401, (path, key, body)
            assert orjson.loads(body)["error"]["code"] == "invalid_api_key"
            assert headers["www-authenticate"] == "Bearer"
    req = urllib.request.Request(
        console_stack.server.base + f"/console/api/batches/{bid}/cancel", method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 401
    assert console_stack.status(bid)["cancelled"] == 0


def test_a_team_sees_only_its_own_batches(console_stack: Stack) -> None:
    tag = uuid.uuid4().hex[:6]
    mine = console_stack.submit(lines(2, f"a{tag}"), key=KEY_A)
    theirs = console_stack.submit(lines(2, f"b{tag}"), key=KEY_B)
    nobody = console_stack.submit(lines(2, f"n{tag}"), key=None)  # a CLI batch without a team key
    listed = {
        key: {b["id"] for b in orjson.loads(console_stack.get("/console/api/batches", key)[1])["batches"]}
        for key in (KEY_A, KEY_B)
    }
    assert mine in listed[KEY_A] and theirs not in listed[KEY_A] and nobody not in listed[KEY_A]
    assert theirs in listed[KEY_B] and mine not in listed[KEY_B] and nobody not in listed[KEY_B]
    for sub in ("", "/report", "/labels", "/download?file=output&format=jsonl", "/labels.jsonl"):
        status, body, _ = console_stack.get(f"/console/api/batches/{mine}{sub}", KEY_B)
        assert status == 404, (sub, body)
        assert orjson.loads(body)["error"]["message"] == f"No such Batch object: {mine!r}"
        assert console_stack.get(f"/console/api/batches/{nobody}{sub}", KEY_A)[0] == 404
    # An id that does not exist answers exactly as another team's does.
    assert (
        console_stack.get("/console/api/batches/b-nope", KEY_B)[1].replace(b"b-nope", mine.encode())
        == (console_stack.get(f"/console/api/batches/{mine}", KEY_B)[1])
    )
    status, body, _ = console_stack.get(f"/console/api/batches/{mine}", KEY_A)
    assert status == 200 and orjson.loads(body)["total"] == 2


def test_the_batch_report_downloads_and_retry_guards(console_stack: Stack) -> None:
    tag = uuid.uuid4().hex[:6]
    bad = {"id": f"{tag}-bad", "prompt": "x", "max_tokens": -1}  # refused at submit: a failed result
    bid = console_stack.submit([*lines(3, tag), bad], "--skip-invalid")
    st = console_stack.wait(bid)
    assert st["completed"] == 3 and st["failed"] == 1
    report = orjson.loads(console_stack.get(f"/console/api/batches/{bid}/report", KEY_A)[1])
    assert report["failed"] == 1 and report["errors"][0]["id"] == f"{tag}-bad"
    assert report["errors"][0]["type"] == "invalid_request" and "max_tokens" in report["errors"][0]["message"]
    assert sum(report["finish_reasons"].values()) == 4 and report["finish_reasons"]["error"] == 1
    tp = report["throughput"]
    assert len(tp["tok_s"]) == 40 and sum(tp["tok_s"]) * tp["bin_s"] == pytest.approx(st["completion_tokens"])

    out = console_stack.get(f"/console/api/batches/{bid}/download?file=output&format=openai", KEY_A)
    assert out[0] == 200 and out[2]["content-disposition"] == f'attachment; filename="{bid}_output.jsonl"'
    cli = console_stack.cli(
        "results", bid, "--format", "openai", "--errors", str(console_stack.tmp / "e.jsonl")
    )
    assert out[1] == cli.stdout  # the lines `producer results --format openai` writes
    errs = console_stack.get(f"/console/api/batches/{bid}/download?file=errors&format=jsonl", KEY_A)[1]
    assert [orjson.loads(x)["id"] for x in errs.splitlines()] == [f"{tag}-bad"]
    assert console_stack.get(f"/console/api/batches/{bid}/download?file=all", KEY_A)[0] == 400
    assert console_stack.get(f"/console/api/batches/{bid}/labels", KEY_A)[0] == 400  # not a choices batch

    # A finished batch cannot be cancelled (409); a retry's flags are checked by name.
    req = urllib.request.Request(
        console_stack.server.base + f"/console/api/batches/{bid}/cancel", method="POST",
        headers={"Authorization": f"Bearer {KEY_A}"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 409 and "nothing is left to cancel" in e.value.read().decode()
    retry = urllib.request.Request(
        console_stack.server.base + f"/console/api/batches/{bid}/retry", method="POST", data=b'{"everything": true}',
        headers={"Authorization": f"Bearer {KEY_A}"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(retry, timeout=10)
    assert e.value.code == 400
    retry.data = b'{"failed": true}'
    with urllib.request.urlopen(retry, timeout=10) as r:  # rejected at submit: the CLI's not_retryable
        assert orjson.loads(r.read()) == {"batch_id": bid, "selected": 1, "enqueued": 0, "in_flight": 0,
                                          "not_retryable": 1}  # fmt: skip


def test_label_rows_show_what_differs_from_the_instruction_every_row_shares(console_stack: Stack) -> None:
    tag = uuid.uuid4().hex[:6]
    bid = console_stack.submit(shared_instruction_lines(tag))
    assert console_stack.wait(bid)["completed"] == len(REVIEWS)
    d = orjson.loads(console_stack.get(f"/console/api/batches/{bid}/labels", KEY_A)[1])
    assert d["input_shared"] == SHARED + " "  # said once, not on every row
    rows = {r["id"]: r for r in d["least_confident"]}
    for i, text in enumerate(REVIEWS):
        row = rows[f"{tag}-{i + 1}"]
        assert row["index"] == i  # the result's index, from 0; the page numbers rows from 1
        assert row["input"] == f"{SHARED} {text} Sentiment:"  # the whole input stays, for the asking
        assert row["input_differs"] == f"{text} Sentiment:"
    export = console_stack.get(f"/console/api/batches/{bid}/labels.jsonl", KEY_A)[1]
    assert sorted(orjson.loads(x)["input"] for x in export.splitlines()) == sorted(
        r["input"] for r in rows.values()
    )


def test_the_workers_page_reads_the_heartbeats(console_stack: Stack) -> None:
    data = orjson.loads(console_stack.get("/console/api/workers", KEY_A)[1])
    assert data["queue"] == "default"
    (w,) = data["workers"]
    assert w["worker_id"] == console_stack.worker.id and w["model"] and w["kv_blocks_total"] > 0
    cli = [orjson.loads(x) for x in console_stack.cli("workers", "--json").stdout.splitlines()]
    assert [x["worker_id"] for x in cli] == [w["worker_id"]]


def test_no_key_reaches_the_server_log(console_stack: Stack) -> None:
    console_stack.get("/console/api/batches", KEY_A)
    console_stack.get("/console/api/batches", "sk-wrong-key-in-log")
    log = console_stack.server.log()
    assert "GET /console/api/batches" in log  # the access log is on
    assert KEY_A not in log and KEY_B not in log and "sk-wrong-key-in-log" not in log


def test_an_api_batch_shows_for_its_key_with_its_openai_status(console_stack: Stack) -> None:
    import openai

    tag = uuid.uuid4().hex[:6]
    body = b"".join(
        orjson.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"messages": [{"role": "user", "content": f"{tag} api {i}"}], "max_tokens": 4}})
        + b"\n"
        for i in range(3)
    )  # fmt: skip
    c = openai.OpenAI(base_url=console_stack.server.base + "/v1", api_key=KEY_A)
    f = c.files.create(file=("in.jsonl", body), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    listed = orjson.loads(console_stack.get("/console/api/batches", KEY_A)[1])["batches"]
    assert b.id in [x["id"] for x in listed]
    assert b.id not in [
        x["id"] for x in orjson.loads(console_stack.get("/console/api/batches", KEY_B)[1])["batches"]
    ]
    assert console_stack.get(f"/console/api/batches/{b.id}", KEY_B)[0] == 404
    console_stack.wait(b.id)
    row = orjson.loads(console_stack.get(f"/console/api/batches/{b.id}", KEY_A)[1])
    assert row["api"]["status"] == "completed" and row["api"]["endpoint"] == "/v1/chat/completions"
    assert row["api"]["output_file_id"] == c.batches.retrieve(b.id).output_file_id
    assert row["completed"] == 3


def test_the_console_cancels_an_api_batch_as_the_api_does(console_stack: Stack) -> None:
    import openai

    tag = uuid.uuid4().hex[:6]
    body = b"".join(
        orjson.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"messages": [{"role": "user", "content": f"{tag} long {i}"}], "max_tokens": 400,
                               "ignore_eos": True}})
        + b"\n"
        for i in range(12)
    )  # fmt: skip
    c = openai.OpenAI(base_url=console_stack.server.base + "/v1", api_key=KEY_A)
    f = c.files.create(file=("in.jsonl", body), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    req = urllib.request.Request(
        console_stack.server.base + f"/console/api/batches/{b.id}/cancel", method="POST",
        headers={"Authorization": f"Bearer {KEY_A}"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as r:
        assert orjson.loads(r.read())["batch"]["id"] == b.id
    assert c.batches.retrieve(b.id).status in ("cancelling", "cancelled")
    st = console_stack.wait(b.id)
    assert st["state"] == "cancelled" and st["cancelled"] > 0
    deadline = 60
    while (got := c.batches.retrieve(b.id)).status != "cancelled" and deadline:
        deadline -= 1
        time.sleep(0.5)
    assert got.status == "cancelled" and got.request_counts is not None
    assert got.request_counts.completed + got.request_counts.failed < 12
