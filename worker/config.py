"""Worker settings: defaults < configs/worker.toml < command-line flags."""

from __future__ import annotations

import dataclasses
import os
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass
class WorkerConfig:
    model: str = "smollm2-135m"
    redis_url: str = field(default_factory=lambda: os.environ.get("REDIS_URL", DEFAULT_REDIS_URL))
    queue: str = "default"
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    # engine
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_gb: float | None = None
    kv_watermark: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    attention_backend: str = "auto"
    repetition_window: int = 10
    repetition_repeats: int = 3
    # queue behaviour
    prefetch: int | None = None  # requests held beyond max_num_seqs so the batch never runs dry
    poll_delay_s: float = 0.2
    lease_s: float = 30.0
    max_tries: int = 3
    shutdown_grace_s: float = 30.0
    stall_s: float = 300.0
    heartbeat_s: float = 5.0
    log_interval_s: float = 10.0
    result_ttl_s: float = 7 * 24 * 3600.0
    burst: bool = False  # exit when the queue is empty (tests, one-shot jobs)

    @property
    def max_jobs(self) -> int:
        extra = self.prefetch if self.prefetch is not None else max(4, self.max_num_seqs // 2)
        return self.max_num_seqs + extra

    def validate(self) -> None:
        checks = {
            "lease_s": self.lease_s > 0,
            "max_tries": self.max_tries >= 1,
            "shutdown_grace_s": self.shutdown_grace_s >= 0,
            "stall_s": self.stall_s > 0,
            "max_num_seqs": self.max_num_seqs >= 1,
            "kv_watermark": 0 < self.kv_watermark <= 1,
            "block_size": self.block_size >= 1,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                f"invalid worker setting(s): {', '.join(f'{k}={getattr(self, k)!r}' for k in bad)}"
            )


def load_config(path: str | Path | None, overrides: dict[str, Any]) -> WorkerConfig:
    """Build the config from a TOML file (optional) and explicit overrides (None values are ignored)."""
    values: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(WorkerConfig)}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file not found: {p}")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{p}: invalid TOML: {e}") from None
        table = data.get("worker", data)
        for key, value in table.items():
            if key not in names:
                raise ValueError(f"{p}: unknown setting {key!r} (known: {', '.join(sorted(names))})")
            values[key] = value
    values.update({k: v for k, v in overrides.items() if v is not None})
    cfg = WorkerConfig(**values)
    cfg.validate()
    return cfg
