"""The arq Worker internals worker/queue_worker.py overrides or calls are there, shaped and behaving as it
expects.

arq does not promise them (`_poll_iteration`, `sem`, `_release_sem_dec_counter_on_complete`, start_jobs'
hand-off, the job counter); pyproject pins arq to the minor version checked here, and an arq that moves
them fails this test instead of a worker in production.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path
from typing import Any

import pytest
from arq.connections import ArqRedis
from arq.worker import Worker, func

import worker.queue_worker as queue_worker

# Worker methods QueueWorker overrides or calls: async or not, and their parameters.
METHODS = {
    "_poll_iteration": (True, ["self"]),
    "start_jobs": (True, ["self", "job_ids"]),
    "run_job": (True, ["self", "job_id", "score"]),
    "finish_job": (True, ["self", "job_id", "finish", "result_data", "result_timeout_s", "keep_result_forever",
                          "incr_score", "keep_in_progress"]),
    "_release_sem_dec_counter_on_complete": (False, ["self"]),
    "main": (True, ["self"]),
}  # fmt: skip


async def noop(ctx: dict[str, Any]) -> None:
    return None


def constructor_keywords() -> set[str]:
    """The keywords QueueWorker.__init__ passes to arq's Worker.__init__, read from its source."""
    tree = ast.parse(Path(inspect.getfile(queue_worker)).read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "QueueWorker"]
    calls = [
        n
        for n in ast.walk(cls)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "__init__"
    ]
    assert len(calls) == 1
    return {k.arg for k in calls[0].keywords if k.arg is not None}


def test_the_worker_methods_queue_worker_relies_on_keep_their_signatures() -> None:
    for name, (is_async, params) in METHODS.items():
        method = getattr(Worker, name)
        assert inspect.iscoroutinefunction(method) is is_async, name
        assert list(inspect.signature(method).parameters) == params, name


def test_the_constructor_takes_every_keyword_queue_worker_passes() -> None:
    passed = constructor_keywords() | {"redis_pool"}  # worker/service.py adds the pool
    assert {"functions", "queue_read_limit", "job_serializer", "job_deserializer"} <= passed
    assert passed <= set(inspect.signature(Worker.__init__).parameters)


@pytest.fixture
async def arq_worker(redis_url: str) -> Any:
    """A plain arq Worker on the test Redis, made as QueueWorker makes its own."""
    pool = ArqRedis.from_url(redis_url)
    w = Worker(functions=[func(noop, name="noop")], redis_pool=pool, queue_name="arq-probe", max_jobs=2,
               queue_read_limit=2, poll_delay=0, handle_signals=False, keep_result=0)  # fmt: skip
    yield w
    await pool.aclose()


async def test_the_attributes_queue_worker_reads_and_writes(arq_worker: Worker) -> None:
    w = arq_worker
    assert isinstance(w.sem, asyncio.Semaphore)
    assert (w.job_counter, w.tasks, w.allow_pick_jobs, w.main_task) == (0, {}, True, None)
    assert (w.max_jobs, w.queue_read_limit, w.queue_name) == (2, 2, "arq-probe")
    assert w.loop is asyncio.get_running_loop() and isinstance(w.pool, ArqRedis)


async def test_a_finished_job_gives_back_its_slot_through_the_private_callback(arq_worker: Worker) -> None:
    """QueueWorker takes a slot (sem + job_counter) itself and hands the task's end to this callback."""
    w = arq_worker
    while not w.sem.locked():  # every slot taken
        await w.sem.acquire()
    w.job_counter = 1
    w._release_sem_dec_counter_on_complete()
    assert w.job_counter == 0 and not w.sem.locked()


async def test_arqs_poll_hands_a_page_of_due_ids_to_start_jobs(arq_worker: Worker) -> None:
    """QueueWorker replaces start_jobs and wraps _poll_iteration: the poll must still read at most
    queue_read_limit due ids, in score order, and pass them to start_jobs, only while jobs may be picked."""
    w = arq_worker
    seen: list[list[bytes]] = []

    async def start_jobs(job_ids: list[bytes]) -> None:
        seen.append(job_ids)

    w.start_jobs = start_jobs  # type: ignore[method-assign]
    await w.pool.zadd("arq-probe", {"a": 1, "b": 2, "c": 3, "later": 2**52})
    await w._poll_iteration()
    assert seen == [[b"a", b"b"]]
    w.allow_pick_jobs = False
    await w._poll_iteration()
    assert seen == [[b"a", b"b"]]
