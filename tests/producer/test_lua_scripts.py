"""The Redis scripts as files (producer/wire/lua/): each documents its interface in its head, none is dead
text, and a script cannot drift from the Python constants it hard-codes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from arq.constants import in_progress_key_prefix, job_key_prefix, retry_key_prefix
from redis.asyncio import Redis

from producer.wire import store
from producer.wire.lua import SCRIPTS, LuaScript, read_script

ROOT = Path(__file__).resolve().parents[2]
# Lua functions that scripts include; they are not run alone and have no KEYS or ARGV of their own.
LIBRARIES = {"write_many.lua", "start_many.lua", "job_keys.lua"}


def loaded_scripts() -> set[str]:
    """The files the producer and the worker pass to LuaScript.load, read from their source."""
    names = set()
    for path in [*(ROOT / "producer").rglob("*.py"), *(ROOT / "worker").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "LuaScript"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names.add(str(node.args[0].value))
    return names


def head(name: str) -> str:
    lines = (SCRIPTS / name).read_text().splitlines()
    return "\n".join(line for line in lines[: next(i for i, x in enumerate(lines) if not x.startswith("--"))])


def test_every_script_is_run_and_every_library_included() -> None:
    files = {p.name for p in SCRIPTS.glob("*.lua")}
    loaded = loaded_scripts()
    included = {
        lib for lib in LIBRARIES if any(f"-- @include {lib}" in (SCRIPTS / f).read_text() for f in files)
    }
    assert loaded == files - LIBRARIES
    assert included == LIBRARIES


def test_each_script_opens_with_its_keys_argv_and_what_it_returns() -> None:
    for path in sorted(SCRIPTS.glob("*.lua")):
        text = head(path.name)
        if path.name in LIBRARIES:
            assert "Included by" in text and "not run alone" in text, path.name
        else:
            assert "\n-- KEYS: " in text and "\n-- ARGV: " in text and "\n-- Returns " in text, path.name


def test_a_script_that_disagrees_with_python_does_not_load() -> None:
    arq = {
        "JOB_KEY": job_key_prefix,
        "IN_PROGRESS_KEY": in_progress_key_prefix,
        "RETRY_KEY": retry_key_prefix,
    }
    LuaScript.load("dequeue.lua", **arq)
    with pytest.raises(
        ValueError, match=r"dequeue\.lua disagrees .*JOB_KEY is 'arq:job:' in the script, 'x:'"
    ):
        LuaScript.load("dequeue.lua", **{**arq, "JOB_KEY": "x:"})
    with pytest.raises(ValueError, match="RETRY_KEY is 'arq:retry:' in the script, not given in Python"):
        LuaScript.load("dequeue.lua", JOB_KEY=job_key_prefix, IN_PROGRESS_KEY=in_progress_key_prefix)
    with pytest.raises(ValueError, match="REASON_COUNTERS"):  # an include's constants are the script's
        LuaScript.load("write_result.lua", REASON_COUNTERS={**store.REASON_COUNTERS, "abort": "aborted"})


async def test_the_job_keys_library_names_a_batchs_keys_as_store_does(redis: Redis) -> None:
    script = LuaScript(read_script("job_keys.lua") + "\nreturn batch_keys(ARGV[1])")
    got = await script(redis, [], ["b-1:x"])
    assert [k.decode() for k in got] == store.batch_keys("b-1:x")
