"""Submitting batches into a real Redis: arq's job format, all-or-nothing, idempotence, --skip-invalid."""

from __future__ import annotations

import io
import time
from pathlib import Path

import orjson
import pytest
import redis as sync_redis
from arq.constants import job_key_prefix
from arq.jobs import deserialize_job
from redis.asyncio import Redis

from producer.client import enqueue as enqueue_module
from producer.client.batchq_client import BatchqClient
from producer.client.submit import InputError, submit_stream
from producer.wire import keys, serde, store
from producer.wire.request_params import Request, SamplingParams
from producer.wire.results import Result
from producer.wire.workers import Heartbeat, QueueServing

GOOD = b'{"id": "a", "prompt": "one"}\n{"id": "b", "messages": [{"role": "user", "content": "two"}]}\n'


async def submit(redis: Redis, data: bytes, **kw: object) -> store.BatchStatus:
    report = await submit_stream(redis, io.BytesIO(data), **kw)  # type: ignore[arg-type]
    return await store.get_status(redis, report.batch_id)


async def test_jobs_are_in_arqs_own_format_and_parse_back_to_requests(redis: Redis) -> None:
    await submit(redis, GOOD, batch_id="b1", queue="q", model="smollm2-135m")
    queue = keys.queue_name("q")
    assert await redis.zrange(queue, 0, -1) == [b"b1:0", b"b1:1"]
    raw = await redis.get(job_key_prefix + keys.job_id("b1", 1))
    assert raw is not None
    assert await redis.ttl(job_key_prefix + "b1:1") == -1  # a queued job never expires
    job = deserialize_job(raw, deserializer=serde.job_deserializer)
    assert job.function == keys.JOB_FUNCTION and job.kwargs == {}
    req = Request.model_validate(job.args[0])
    assert (req.batch_id, req.id, req.index, req.model) == ("b1", "b", 1, "smollm2-135m")
    assert req.enqueued_at > 0 and req.params.max_new_tokens == 256


async def test_longest_generations_are_queued_first_and_batches_stay_fifo(redis: Redis) -> None:
    # Workers pull in score order: within a batch the longest max_new_tokens come out first, so they do
    # not decode alone at the batch's tail; a later batch still comes after every job of an earlier one.
    lens = [8, 256, 16, 64, 256, 40]  # distinct in steps of ORDER_TOKENS_PER_LEVEL (8)
    lines = b"".join(b'{"prompt": "p", "max_new_tokens": %d}\n' % n for n in lens)
    await submit(redis, lines, batch_id="early", queue="q")
    await submit(redis, b'{"prompt": "p", "max_new_tokens": 4000}\n', batch_id="late", queue="q")
    queued = await redis.zrange(keys.queue_name("q"), 0, -1, withscores=True)
    ids = [jid.decode() for jid, _ in queued]
    assert [lens[int(i.split(":")[1])] for i in ids[:6]] == [256, 256, 64, 40, 16, 8]
    assert ids[6] == "late:0"
    early = [score for jid, score in queued if jid.startswith(b"early:")]
    assert max(early) - min(early) < 1  # one millisecond: the order is a fraction of the enqueue time


async def test_batches_enqueued_within_one_millisecond_stay_fifo(redis: Redis) -> None:
    # Each submit claims an enqueue millisecond strictly after the queue's last one. With a clock that
    # says "this millisecond is taken" far ahead, both batches still get consecutive, ordered ones, and
    # the later batch's longest request does not jump ahead of the earlier batch.
    qname = keys.queue_name("q")
    taken = 4_000_000_000_000  # year 2096: later than any clock here
    await redis.set(keys.queue_clock(qname), taken)
    await submit(redis, b'{"prompt": "p", "max_new_tokens": 8}\n', batch_id="early", queue="q")
    await submit(redis, b'{"prompt": "p", "max_new_tokens": 4000}\n', batch_id="late", queue="q")
    queued = await redis.zrange(qname, 0, -1, withscores=True)
    assert [jid for jid, _ in queued] == [b"early:0", b"late:0"]
    assert [int(score) for _, score in queued] == [taken + 1, taken + 2]


async def test_batch_meta_records_total_queue_model_and_defaults(redis: Redis) -> None:
    defaults = SamplingParams(max_new_tokens=12, temperature=0)
    status = await submit(redis, GOOD, batch_id="b1", model="m", defaults=defaults)
    assert (status.state, status.total, status.queued, status.queue, status.model) == (
        "queued", 2, 2, "batchq:queue:default", "m"
    )  # fmt: skip
    meta = await store.get_meta(redis, "b1")
    assert orjson.loads(meta["defaults"]) == {"max_new_tokens": 12, "temperature": 0.0}
    assert await redis.zscore(keys.BATCHES, "b1") == pytest.approx(status.created_at)


async def test_an_invalid_file_enqueues_nothing_and_creates_no_batch(redis: Redis) -> None:
    with pytest.raises(InputError) as e:
        await submit(redis, GOOD + b'{"prompt": "x", "temperature": -2}\n', batch_id="b1")
    assert [str(x) for x in e.value.errors] == [
        "line 3: temperature: Input should be greater than or equal to 0"
    ]
    assert await redis.keys("*") == []


async def test_an_empty_or_blank_file_is_refused(redis: Redis) -> None:
    for data in (b"", b"\n  \n\n"):
        with pytest.raises(InputError, match="input is empty"):
            await submit(redis, data)
    assert await redis.keys("*") == []


async def test_resubmitting_the_same_batch_enqueues_nothing_twice(redis: Redis) -> None:
    first = await submit_stream(redis, io.BytesIO(GOOD), batch_id="b1")
    assert first.enqueued == 2
    again = await submit_stream(redis, io.BytesIO(GOOD), batch_id="b1")
    assert (again.total, again.enqueued) == (2, 0)
    assert await redis.zcard(keys.DEFAULT_QUEUE) == 2


async def test_resubmitting_skips_requests_whose_result_exists(redis: Redis) -> None:
    await submit_stream(redis, io.BytesIO(GOOD), batch_id="b1")
    # What a worker does: take job 0 off the queue, run it, store its result.
    await redis.zrem(keys.DEFAULT_QUEUE, "b1:0")
    await redis.delete(job_key_prefix + "b1:0")
    await store.write_result(redis, "b1", Result(id="a", index=0, text="t", finish_reason="eos"))
    again = await submit_stream(redis, io.BytesIO(GOOD), batch_id="b1")
    assert again.enqueued == 0
    assert await redis.zrange(keys.DEFAULT_QUEUE, 0, -1) == [b"b1:1"]


async def test_a_different_file_under_an_existing_batch_id_is_refused(redis: Redis) -> None:
    await submit_stream(redis, io.BytesIO(GOOD), batch_id="b1")
    with pytest.raises(
        InputError, match="already exists with other content: it holds 2 requests, this input 3"
    ):
        await submit_stream(redis, io.BytesIO(GOOD + b'{"prompt": "3"}\n'), batch_id="b1")


async def test_the_same_id_with_other_content_of_the_same_length_is_refused_naming_the_line(
    redis: Redis,
) -> None:
    """A nightly job reusing its batch id with another day's file (the same line count): refused, naming
    the first line that differs; nothing of the old batch is touched. The same file again is a no-op."""
    day1 = b'{"id": "a", "prompt": "one"}\n\n{"id": "b", "prompt": "two"}\n{"id": "c", "prompt": "three"}\n'
    day2 = b'{"id": "a", "prompt": "one"}\n\n{"id": "b", "prompt": "TWO"}\n{"id": "c", "prompt": "three"}\n'
    first = await submit_stream(redis, io.BytesIO(day1), batch_id="nightly-2026-11-30")
    assert first.enqueued == 3
    with pytest.raises(InputError, match=r"other content: line 3 \(request 2\) differs"):
        await submit_stream(redis, io.BytesIO(day2), batch_id="nightly-2026-11-30")
    with pytest.raises(InputError, match=r"line 1 \(request 1\) differs"):  # other batch defaults
        await submit_stream(
            redis, io.BytesIO(day1), batch_id="nightly-2026-11-30", defaults=SamplingParams(seed=1)
        )
    again = await submit_stream(redis, io.BytesIO(day1), batch_id="nightly-2026-11-30")
    assert (again.total, again.enqueued) == (3, 0)  # idempotent
    assert await redis.zcard(keys.DEFAULT_QUEUE) == 3
    jobs = [
        orjson.loads(await redis.get(job_key_prefix + f"nightly-2026-11-30:{i}"))["a"][0] for i in range(3)
    ]
    assert [j["prompt"] for j in jobs] == ["one", "two", "three"]


async def test_skip_invalid_enqueues_valid_lines_and_records_failed_results(redis: Redis) -> None:
    data = b'{"id": "a", "prompt": "one"}\n{"id": "bad", "prompt": "x", "top_k": -1}\nnot json\n'
    report = await submit_stream(redis, io.BytesIO(data), batch_id="b1", skip_invalid=True)
    assert (report.total, report.enqueued, report.invalid) == (3, 1, 2)
    status = await store.get_status(redis, "b1")
    assert (status.failed, status.queued, status.state) == (2, 1, "running")
    results = [r async for r, _ in store.iter_results(redis, "b1")]
    assert [(r.id, r.index, r.finish_reason) for r in results] == [("bad", 1, "error"), ("3", 2, "error")]
    assert all(r.error is not None and r.error.type == "invalid_request" for r in results)
    assert results[0].error is not None and "top_k" in results[0].error.message


async def test_a_10mb_prompt_is_enqueued_whole(redis: Redis) -> None:
    prompt = "z" * (10 * 1024 * 1024)
    await submit(redis, orjson.dumps({"prompt": prompt}) + b"\n" + GOOD.split(b"\n")[0], batch_id="big")
    raw = await redis.get(job_key_prefix + "big:0")
    assert raw is not None and orjson.loads(raw)["a"][0]["prompt"] == prompt


async def test_client_submits_files_and_python_lines(redis_url: str, tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(GOOD)
    async with BatchqClient.from_url(redis_url) as client:
        report = await client.submit_file(path, batch_id="f1", defaults=SamplingParams(seed=1))
        assert (report.batch_id, report.total, report.enqueued) == ("f1", 2, 2)
        lines = (orjson.dumps({"prompt": f"p{i}"}).decode() for i in range(5))
        report = await client.submit_lines(lines, batch_id="l1")
        assert (await client.status("l1")).total == 5
        with pytest.raises(InputError, match="no such file"):
            await client.submit_file(tmp_path / "missing.jsonl")
        with pytest.raises(InputError, match="invalid batch id"):
            await client.submit_lines(['{"prompt": "x"}'], batch_id="no spaces")


async def test_chunks_split_at_invalid_lines_keep_indices_chat_bits_and_order(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small chunks, and --skip-invalid lines between them: every valid line is enqueued under its own
    # index, with its chat bit and its queue order, and every invalid line becomes a failed result.
    monkeypatch.setattr(enqueue_module, "CHUNK_JOBS", 3)
    lines, bad = [], {4, 5, 9}
    for i in range(12):
        if i in bad:
            lines.append(b'{"prompt": "x", "top_k": -1}')
        elif i % 3 == 0:
            lines.append(
                b'{"messages": [{"role": "user", "content": "c%d"}], "max_tokens": %d}' % (i, 8 * i + 8)
            )
        else:
            lines.append(b'{"prompt": "p%d", "max_tokens": %d}' % (i, 8 * i + 8))
    report = await submit_stream(redis, io.BytesIO(b"\n".join(lines)), batch_id="b", skip_invalid=True)
    assert (report.enqueued, report.invalid) == (9, 3)
    queued = [jid.decode() for jid in await redis.zrange(keys.DEFAULT_QUEUE, 0, -1)]
    good = [i for i in range(12) if i not in bad]
    assert queued == [f"b:{i}" for i in sorted(good, reverse=True)]  # longest max_tokens first
    for i in good:
        raw = await redis.get(job_key_prefix + f"b:{i}")
        assert raw is not None
        req = Request.model_validate(orjson.loads(raw)["a"][0])
        assert (req.index, req.params.max_new_tokens) == (i, 8 * i + 8)
        assert await redis.getbit(keys.batch_chat("b"), i) == (i % 3 == 0)
    results = [r async for r, _ in store.iter_results(redis, "b")]
    assert [r.index for r in results] == sorted(bad)


async def test_a_chunk_bigger_than_luas_unpack_limit_is_enqueued_whole(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The script collects ZADD members (2 per job) and BITFIELD ops (4 per chat job); Lua's unpack() stops
    # at 8000 values, so a chunk this big must be written in slices.
    monkeypatch.setattr(enqueue_module, "CHUNK_JOBS", 5000)
    n = 4500
    data = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}\n' * n
    report = await submit_stream(redis, io.BytesIO(data), batch_id="big")
    assert report.enqueued == n and await redis.zcard(keys.DEFAULT_QUEUE) == n
    assert await redis.bitcount(keys.batch_chat("big")) == n


async def test_on_created_is_called_once_the_batch_exists_and_before_its_jobs(
    redis_url: str, redis: Redis
) -> None:
    # The CLI uses it to tell a user whose submit was interrupted mid-enqueue how to finish it.
    seen = []

    def created(batch_id: str) -> None:
        r = sync_redis.Redis.from_url(redis_url)
        seen.append((batch_id, r.exists(keys.batch_meta(batch_id)), r.zcard(keys.DEFAULT_QUEUE)))
        r.close()

    await submit_stream(redis, io.BytesIO(GOOD), batch_id="b1", on_created=created)
    assert seen == [("b1", 1, 0)]
    assert await redis.zcard(keys.DEFAULT_QUEUE) == 2


async def test_a_fresh_batch_that_meets_an_existing_job_key_falls_back_to_checking_each_job(
    redis: Redis,
) -> None:
    # A fresh batch writes each chunk's jobs with one MSETNX. Should one job key exist already (another
    # submit of the same batch id racing this one), the chunk goes job by job and skips that job.
    await redis.set(job_key_prefix + "b1:1", b"{}")
    report = await submit_stream(redis, io.BytesIO(GOOD), batch_id="b1")
    assert report.enqueued == 1
    assert await redis.zrange(keys.DEFAULT_QUEUE, 0, -1) == [b"b1:0"]
    assert await redis.get(job_key_prefix + "b1:1") == b"{}"
    assert await redis.getbit(keys.batch_chat("b1"), 1) == 1


async def publish_serving(redis: Redis, queue: str, fp: str, model: str = "smollm2-135m") -> None:
    """What a worker of the queue publishes (worker/service.py publish_serving)."""
    serving = QueueServing(model=model, fingerprint=fp, max_model_len=8192)
    await redis.set(keys.queue_serving(keys.queue_name(queue)), serving.model_dump_json())


async def beat(redis: Redis, queue: str, model: str) -> None:
    """A live worker's heartbeat (worker/queue/health.py)."""
    hb = Heartbeat(
        worker_id="w1", host="h", queue=keys.queue_name(queue), model=model, ts=time.time(), running=0,
        waiting=0, kv_blocks_used=0, kv_blocks_total=1, tokens_generated=0, progress_age_s=0.0, stall_s=60.0,
    )  # fmt: skip
    await redis.set(keys.worker_heartbeat("w1"), hb.model_dump_json(), ex=30)
    await redis.zadd(keys.WORKERS, {"w1": hb.ts})


async def test_a_cached_answer_only_answers_a_request_for_the_model_that_computed_it(redis: Redis) -> None:
    """The same line ran on smollm2-135m; submitted again for another model it is never answered from the
    cache, and for the served model only while a live worker of the queue serves it. A line naming no
    model is the queue's, whatever serves it."""
    from producer.wire.result_cache import CachedAnswer, request_key

    fp = "ab" * 16
    await publish_serving(redis, "q", fp, model="smollm2-135m")
    key = request_key(fp, "label me", None, {"max_new_tokens": 256, "temperature": 0.0})
    assert key is not None
    answer = CachedAnswer(
        text="yes", finish_reason="eos", prompt_tokens=3, completion_tokens=2, model="smollm2-135m"
    )
    await redis.set(key, answer.to_json())
    line = b'{"prompt": "label me", "temperature": 0}\n'

    async def submit(bid: str, **kw: object) -> tuple[int, int]:
        r = await submit_stream(redis, io.BytesIO(line), batch_id=bid, queue="q", **kw)  # type: ignore[arg-type]
        return r.cached, r.enqueued

    assert await submit("other", model="llama-70b-nonexistent") == (0, 1)
    assert await submit("served-no-worker", model="smollm2-135m") == (0, 1)
    assert await submit("unnamed", model=None) == (1, 0)
    await beat(redis, "q", "smollm2-135m")
    assert await submit("other-live", model="llama-70b-nonexistent") == (0, 1)
    assert await submit("aliased", model="gpt-4o-mini", model_aliases={"gpt-4o-mini": "smollm2-135m"}) == (
        1,
        0,
    )
    assert await submit("served-live", model="smollm2-135m") == (1, 0)
    got = [r async for r in _results(redis, "served-live")]
    assert got[0].cached and got[0].model == "smollm2-135m"
    jobs = [orjson.loads(await redis.get(job_key_prefix + f"{b}:0"))["a"][0] for b in ("other", "other-live")]
    assert [j["model"] for j in jobs] == ["llama-70b-nonexistent"] * 2  # the worker refuses them by name


async def _results(redis: Redis, bid: str):  # type: ignore[no-untyped-def]
    async for r, _ in store.iter_results(redis, bid):
        yield r


async def test_max_new_tokens_beyond_the_served_context_is_refused_at_submit_with_the_figures(
    redis: Redis,
) -> None:
    await publish_serving(redis, "q", "cd" * 16)  # a context of 8192
    line = b'{"prompt": "x", "max_new_tokens": 100000000}\n'
    with pytest.raises(InputError) as e:
        await submit_stream(redis, io.BytesIO(line), batch_id="big", queue="q")
    assert [str(le) for le in e.value.errors] == [
        "line 1: max_new_tokens: 100000000 new tokens asked, but the model 'smollm2-135m' serving this "
        "queue holds 8192 tokens in all (prompt and output together)"
    ]
    ok = await submit_stream(
        redis, io.BytesIO(b'{"prompt": "x", "max_new_tokens": 8192}\n'), batch_id="ok", queue="q"
    )
    assert ok.enqueued == 1


async def test_an_uncompilable_schema_or_regex_is_refused_at_submit_naming_line_and_field(
    redis: Redis,
) -> None:
    lines = (
        b'{"prompt": "a", "regex": "[a-z]+"}\n'
        b'{"prompt": "b", "regex": "a("}\n'
        b'{"prompt": "c", "response_format": {"type": "json_schema", "json_schema": {"name": "x", '
        b'"schema": {"type": "nosuch"}}}}\n'
    )
    with pytest.raises(InputError) as e:
        await submit_stream(redis, io.BytesIO(lines), batch_id="g")
    assert [str(le) for le in e.value.errors] == [
        "line 2: regex: cannot compile the regex: unclosed group",
        "line 3: response_format.json_schema.schema: cannot compile the JSON Schema: Invalid type: nosuch",
    ]
    assert not await redis.exists(keys.batch_meta("g"))  # nothing enqueued


async def test_requests_the_result_cache_holds_are_answered_at_submit_and_never_enqueued(
    redis: Redis,
) -> None:
    from producer.wire.result_cache import CachedAnswer, request_key

    fp = "0123456789abcdef" * 2
    await publish_serving(redis, "q", fp)
    lines = (
        b'{"id": "chat", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "metadata": {"k": 1}}\n'
        b'{"id": "text", "prompt": "two", "temperature": 0.5, "seed": 9}\n'
        b'{"id": "new", "prompt": "three", "temperature": 0}\n'
        b'{"id": "free", "prompt": "four", "temperature": 0.5}\n'
    )
    params = {"max_new_tokens": 256, "temperature": 0.0}
    chat_key = request_key(fp, None, [{"role": "user", "content": "hi"}], params)
    text_key = request_key(fp, "two", None, {"max_new_tokens": 256, "temperature": 0.5, "seed": 9})
    assert chat_key and text_key
    from producer.wire.results import LabelScore

    scores = [
        LabelScore(label="hello", logprob=-0.1, prob=0.9),
        LabelScore(label="bye", logprob=-2.3, prob=0.1),
    ]
    answer = CachedAnswer(
        text="hello",
        finish_reason="eos",
        prompt_tokens=5,
        completion_tokens=2,
        cached_tokens=3,
        label_scores=scores,
    )
    await redis.set(chat_key, answer.to_json())
    await redis.set(text_key, answer.model_copy(update={"text": "2"}).to_json())

    report = await submit_stream(redis, io.BytesIO(lines), batch_id="rc", queue="q")  # type: ignore[arg-type]
    assert (report.total, report.cached, report.enqueued) == (4, 2, 2)
    assert await redis.zrange(keys.queue_name("q"), 0, -1) == [b"rc:2", b"rc:3"]
    status = await store.get_status(redis, "rc")
    assert (status.completed, status.from_result_cache, status.state) == (2, 2, "running")
    assert (status.prompt_tokens, status.cached_prompt_tokens, status.completion_tokens) == (10, 6, 4)
    got = [(r, chat) async for r, chat in store.iter_results(redis, "rc")]
    assert [(r.id, r.text, r.cached, chat) for r, chat in got] == [
        ("chat", "hello", True, True),
        ("text", "2", True, False),
    ]
    assert got[0][0].metadata == {"k": 1} and got[0][0].usage.prompt_tokens_details.cached_tokens == 3
    assert got[0][0].label_scores == scores and got[1][0].label_scores == scores  # labeling outputs kept

    again = await submit_stream(redis, io.BytesIO(lines), batch_id="rc2", queue="q", result_cache=False)  # type: ignore[arg-type]
    assert (again.cached, again.enqueued) == (0, 4)


async def test_submit_keeps_each_inputs_excerpt_and_the_owner_for_the_console(redis: Redis) -> None:
    # 4,203 lines: three groups of CHUNK_JOBS, excerpt fields of 500 (store.EXCERPTS_PER_FIELD); line 700
    # is invalid (--skip-invalid: a failed result, no excerpt); chat lines give their last user message.
    n = 2 * enqueue_module.CHUNK_JOBS + 203
    lines = []
    for i in range(n):
        if i == 700:
            lines.append(b'{"id": "bad", "prompt": "p", "max_tokens": -1}\n')
        elif i % 2:
            msgs = [{"role": "user", "content": f"first {i}"}, {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": f"row\n\n{i}  asks"}]  # fmt: skip
            lines.append(orjson.dumps({"messages": msgs}) + b"\n")
        else:
            lines.append(orjson.dumps({"prompt": f"prompt {i} " + "x" * (300 if i == 4000 else 0)}) + b"\n")
    await submit(redis, b"".join(lines), batch_id="ex", skip_invalid=True, owner="team-a")
    client = BatchqClient(redis)
    wanted = [0, 1, 499, 500, 700, 2000, 4000, n - 1, n, 10**6]
    got = await client.input_excerpts("ex", wanted)
    assert set(got) == {0, 1, 499, 500, 2000, 4000, n - 1}
    assert got[0] == "prompt 0" and got[1] == "row 1 asks" and got[499] == "row 499 asks"
    assert got[500] == "prompt 500" and got[n - 1] == f"prompt {n - 1}"
    assert len(got[4000]) == enqueue_module.EXCERPT_CHARS and "\u2026" in got[4000]
    assert (await client.batch_meta("ex"))["owner"] == "team-a"
    assert [s.batch_id for s in await client.owned_batches("team-a", None)] == ["ex"]
    assert (
        await client.owned_batches("team-b", None) == [] and await client.owned_batches("team-a", "q") == []
    )
    assert [s.batch_id for s in await client.owned_batches(None, "default")] == ["ex"]
