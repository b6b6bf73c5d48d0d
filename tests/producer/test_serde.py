"""Queue payloads are JSON only: a pickle placed in the queue is refused, never executed."""

from __future__ import annotations

from pathlib import Path

import pytest
from arq.constants import job_key_prefix
from arq.jobs import (
    DeserializationError,
    deserialize_job,
    deserialize_job_raw,
    serialize_job,
    serialize_result,
)
from redis.asyncio import Redis

from producer.wire import keys, serde


def pickled_shell_command(marker: Path) -> bytes:
    # Protocol-0 pickle calling os.system (module "posix" on Linux); written as bytes so no pickle import.
    return b"cposix\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."


def test_a_pickled_payload_is_refused_and_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickled_shell_command(marker)
    with pytest.raises(serde.PayloadRefused):
        serde.job_deserializer(payload)
    with pytest.raises(DeserializationError):  # what arq's worker sees: the job fails, nothing runs
        deserialize_job(payload, deserializer=serde.job_deserializer)
    protocol2 = b"\x80\x02cposix\nsystem\nq\x00X\x05\x00\x00\x00touchq\x01\x85q\x02Rq\x03."
    with pytest.raises(serde.PayloadRefused):
        serde.job_deserializer(protocol2)
    assert not marker.exists()


@pytest.mark.parametrize("raw", [b"", b"[1, 2]", b'"text"', b"{not json", b"\xff\xfe"])
def test_non_object_payloads_are_refused(raw: bytes) -> None:
    with pytest.raises(serde.PayloadRefused):
        serde.job_deserializer(raw)


def test_jobs_round_trip_through_arqs_own_functions() -> None:
    raw = serialize_job(
        "run_request", ({"id": "a"},), {}, None, 1700000000000, serializer=serde.job_serializer
    )
    job = deserialize_job(raw, deserializer=serde.job_deserializer)
    assert (job.function, job.args, job.kwargs, job.job_try) == ("run_request", [{"id": "a"}], {}, None)


def test_a_failed_job_result_holding_an_exception_still_serialises() -> None:
    raw = serialize_result(
        "run_request",
        (),
        {},
        1,
        0,
        False,
        ValueError("bad"),
        0,
        1,
        "ref",
        "q",
        "j",
        serializer=serde.job_serializer,
    )
    assert raw is not None and serde.job_deserializer(raw)["r"] == "ValueError: bad"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://alice:s3cret@host:6380/1", "redis://alice:***@host:6380/1"),
        ("rediss://:s3cret@host/0", "rediss://:***@host/0"),
        ("redis://s3cret@host", "redis://***@host"),
        ("redis://u:s3cret@[::1]:6379", "redis://u:***@[::1]:6379"),
    ],
)
def test_mask_url_hides_passwords(url: str, shown: str) -> None:
    assert serde.mask_url(url) == shown


async def test_a_pickle_placed_in_the_queue_is_refused_when_read_back(redis: Redis, tmp_path: Path) -> None:
    marker = tmp_path / "pwned-from-redis"
    await redis.set(job_key_prefix + "evil:0", pickled_shell_command(marker))
    await redis.zadd(keys.DEFAULT_QUEUE, {"evil:0": 1})
    raw = await redis.get(job_key_prefix + "evil:0")
    assert raw is not None
    with pytest.raises(DeserializationError):
        deserialize_job_raw(raw, deserializer=serde.job_deserializer)  # the call arq's worker makes
    assert not marker.exists()
