"""Worker settings, one typed tree: WorkerConfig (queue behaviour) nests EngineConfig (the engine's).

Precedence: the defaults defined on the models < a TOML file given with `--config` < command-line
flags. The TOML file mirrors the tree: worker settings at the top level, engine settings under
`[engine]` (configs/worker.toml lists every one). Everything is validated once, by pydantic, and a bad
key or value is a ConfigError that names it and where it came from (the file, or the flag).
"""

from __future__ import annotations

import os
import socket
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from producer.wire import keys
from worker.engine_config import EngineConfig


class ConfigError(ValueError):
    pass


STAND_IN_MODEL = "stand-in"  # the model name a stand-in worker serves (worker/queue/stand_in.py)


def _default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class WorkerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    engine: EngineConfig = Field(default_factory=EngineConfig)
    redis_url: str = Field(
        default_factory=keys.redis_url_from_env,
        description=f"default: ${keys.REDIS_URL_ENV}, else {keys.DEFAULT_REDIS_URL}",
    )
    queue: str = Field(default="default", min_length=1, description="queue name (one model per queue)")
    worker_id: str = Field(default_factory=_default_worker_id, min_length=1, description="default: HOST:PID")
    prefetch: int | None = Field(
        default=None,
        ge=0,
        description="requests held beyond max_num_seqs (default: max(4, max_num_seqs / 2))",
    )
    poll_delay_s: float = Field(default=0.2, gt=0, description="queue poll interval when idle")
    lease_s: float = Field(
        default=30.0, gt=0, description="lease on a running request, renewed while alive; a killed "
        "worker's requests are taken over within it",
    )  # fmt: skip
    max_tries: int = Field(default=3, ge=1, description="tries before a request fails with an error")
    shutdown_grace_s: float = Field(default=30.0, ge=0, description="SIGTERM: time to finish in-flight work")
    stall_s: float = Field(
        default=300.0, gt=0, description="exit with status 70 after this long without progress"
    )
    heartbeat_s: float = Field(default=5.0, gt=0, description="heartbeat interval")
    log_interval_s: float = Field(default=10.0, gt=0, description="stats line interval")
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="serve Prometheus metrics at http://0.0.0.0:PORT/metrics (0: any free port; default: off)",
    )
    result_ttl_s: float = Field(
        default=float(keys.DEFAULT_RESULT_TTL_S), gt=0, description="how long results are kept (7 days)"
    )
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="engine groups on this machine (data parallelism), each a worker of its own on "
        "tensor_parallel_size GPUs, under one supervisor that restarts a dead one",
    )
    gpus: str | None = Field(
        default=None,
        description='the GPUs the groups take, in order ("0,1,2,3"; default: every visible GPU)',
    )
    burst: bool = Field(default=False, description="exit once the queue is empty (tests, one-shot jobs)")
    result_cache: bool = Field(
        default=True,
        description="answer a determined request (greedy, or seeded) from the stored answer of an identical one",
    )
    result_cache_ttl_s: float = Field(
        default=float(keys.DEFAULT_RESULT_TTL_S),
        gt=0,
        description="how long cached answers are kept (7 days)",
    )
    image_urls: bool = Field(
        default=False,
        description="fetch the http(s) image URLs of chat requests (else submit refuses them: images are "
        "sent in the batch, stored in Redis)",
    )
    image_fetch_timeout_s: float = Field(default=10.0, gt=0, description="with image_urls: per image fetched")
    image_fetch_max_bytes: int = Field(
        default=20 * 1024 * 1024, ge=1, description="with image_urls: the largest image fetched (20 MiB)"
    )

    engine_stand_in: bool = Field(
        default=False,
        description="benchmarks and tests only: answer every request at once without a model "
        "(worker/queue/stand_in.py), to measure the queue path alone; needs --model stand-in",
    )

    @model_validator(mode="after")
    def _stand_in_serves_no_real_model(self) -> WorkerConfig:
        if self.engine_stand_in != (self.engine.model == STAND_IN_MODEL):
            raise ValueError(
                f"engine_stand_in and model {STAND_IN_MODEL!r} go together (the stand-in answers without a "
                "model, so it must not take a real model's queue)"
            )
        return self

    @property
    def max_jobs(self) -> int:
        """Requests held at once: the engine's batch plus a prefetch so it never runs dry."""
        max_seqs = self.engine.max_num_seqs
        extra = self.prefetch if self.prefetch is not None else max(4, max_seqs // 2)
        return max_seqs + extra


ENGINE_SETTINGS = frozenset(EngineConfig.model_fields)
WORKER_SETTINGS = frozenset(WorkerConfig.model_fields) - {"engine"}
assert not ENGINE_SETTINGS & WORKER_SETTINGS, "one flag per setting: names must differ across the tree"


def load_config(path: str | Path | None, flags: dict[str, Any]) -> WorkerConfig:
    """Defaults < the TOML file at `path` (if any) < `flags` (setting name -> value; None = not given)."""
    tree: dict[str, Any] = _read_toml(Path(path)) if path is not None else {}
    given = {k: v for k, v in flags.items() if v is not None}
    engine = tree.get("engine", {})
    if isinstance(engine, dict):  # anything else is left for validation to name
        engine = {**engine, **{k: v for k, v in given.items() if k in ENGINE_SETTINGS}}
    values = {**tree, **{k: v for k, v in given.items() if k not in ENGINE_SETTINGS}, "engine": engine}
    try:
        return WorkerConfig.model_validate(values)
    except ValidationError as e:
        raise ConfigError(_describe(e, path, given)) from None


def _read_toml(p: Path) -> dict[str, Any]:
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from None


def _describe(e: ValidationError, path: str | Path | None, flags: dict[str, Any]) -> str:
    """One line per problem: where the value came from (flag or file and table), the key, what is wrong."""
    lines = []
    for err in e.errors():
        loc = [str(x) for x in err["loc"]]
        name = loc[-1]
        in_engine = loc[0] == "engine" and len(loc) > 1
        if name in flags and (in_engine == (name in ENGINE_SETTINGS)):
            where = f"--{name.replace('_', '-')}"
        else:
            table = "[engine] " if in_engine else ""
            where = f"{path}: {table}{name}" if path is not None else f"{'.'.join(loc)}"
        if err["type"] == "value_error" and loc == ["engine"]:  # a rule across engine settings
            lines.append(
                f"{f'{path}: ' if path is not None else ''}[engine]: {err['msg'].removeprefix('Value error, ')}"
            )
        elif err["type"] == "extra_forbidden":
            known = ENGINE_SETTINGS if in_engine else WORKER_SETTINGS | {"engine"}
            lines.append(f"{where}: unknown setting (known: {', '.join(sorted(known))})")
        else:
            lines.append(f"{where} = {err.get('input')!r}: {err['msg']}")
    return "; ".join(lines)
