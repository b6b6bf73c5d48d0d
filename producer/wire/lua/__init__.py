"""Redis call helpers, and the Lua scripts batchq runs: one `.lua` file each in this folder (package data),
read once at import and run by SHA (reloaded after a restart flushed the script cache).

Each file's head comment gives its KEYS, its ARGV and what it returns. A line `-- @include NAME.lua` stands
for that file's text: the Lua functions several scripts share (write_many, start_many, the job-key
helpers), so that each has one copy. Includes are resolved at load, so what Redis runs is a fixed text.

A name or number a script shares with Python (an arq key prefix, a meta field, a table of counters) is an
upper-case local at the top of its file, `local JOB_KEY = 'arq:job:'`. The Python that loads the script
passes the value it owns for each one (`LuaScript.load("enqueue.lua", JOB_KEY=job_key_prefix)`), and
loading fails when the two disagree or a script declares one that Python does not vouch for.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

T = TypeVar("T")
SCRIPTS = Path(__file__).parent
_INCLUDE = re.compile(r"^-- @include (\S+\.lua)$", re.M)
_CONSTANT = re.compile(r"^local ([A-Z][A-Z0-9_]*) = (.*)$", re.M)

LuaValue = str | int | Mapping[str, str]


async def done(value: Awaitable[T] | T) -> T:
    """redis-py types each command as sync-or-async; on a redis.asyncio client it is always awaitable."""
    return await cast(Awaitable[T], value)


def read_script(name: str) -> str:
    """The text of SCRIPTS/`name` with its includes resolved."""
    text = (SCRIPTS / name).read_text()
    return _INCLUDE.sub(lambda m: read_script(m.group(1)).rstrip("\n"), text)


def lua_literal(value: LuaValue) -> str:
    """How a script's head writes `value`: 'text', 42, or {key = 'text', ...}."""
    if isinstance(value, str):
        assert "'" not in value and "\\" not in value, value
        return f"'{value}'"
    if isinstance(value, int):
        return str(value)
    return "{" + ", ".join(f"{k} = {lua_literal(v)}" for k, v in value.items()) + "}"


def check_constants(name: str, source: str, constants: Mapping[str, LuaValue]) -> None:
    """Raise unless the upper-case locals of `source` are exactly `constants`, each written as Python's."""
    declared: dict[str, set[str]] = {}
    for const, text in _CONSTANT.findall(source):
        declared.setdefault(const, set()).add(text.strip())
    expected = {const: lua_literal(v) for const, v in constants.items()}
    wrong = sorted(
        f"{const} is {' or '.join(sorted(declared.get(const, ()))) or 'not declared'} in the script, "
        f"{expected.get(const, 'not given')} in Python"
        for const in declared.keys() | expected.keys()
        if declared.get(const) != {expected.get(const)}
    )
    if wrong:
        raise ValueError(f"{name} disagrees with the Python that runs it: " + "; ".join(wrong))


class LuaScript:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    @classmethod
    def load(cls, name: str, **constants: LuaValue) -> LuaScript:
        """The script in SCRIPTS/`name`; `constants`: the value Python owns for each constant it declares."""
        source = read_script(name)
        check_constants(name, source, constants)
        return cls(source)

    async def __call__(self, redis: Redis, keys: list[str], args: list[Any]) -> Any:
        try:
            return await done(redis.evalsha(self.sha, len(keys), *keys, *args))
        except NoScriptError:
            await redis.script_load(self.source)
            return await done(redis.evalsha(self.sha, len(keys), *keys, *args))
