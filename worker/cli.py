"""`worker`: serve one model on one queue, or `worker --check` for a health probe."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import sys
from typing import Any, Literal, get_args, get_origin

from pydantic.fields import FieldInfo

from producer.wire import serde
from worker.config import ConfigError, WorkerConfig, load_config
from worker.engine_config import EngineConfig

EPILOG = """\
examples:
  worker --model smollm2-135m
  worker --model ./my-llama-checkpoint --queue llama --device cuda --kv-watermark 0.85
  worker --config configs/worker.toml --redis-url rediss://user:secret@redis.example:6380/0
  worker --config my-worker.toml --max-num-seqs 128   # flags override the file's settings
  worker --check --queue llama        # exit 0 if a live, progressing worker serves the queue here

exit status: 0 normal stop, 1 failed check / start-up error, 2 bad arguments, config or model, 3 engine failed
(a tensor-parallel rank died or hung: the leased requests run elsewhere), 70 stalled engine
"""
# What serving needs beyond a producer install: pyproject's [worker] extra (`pip install batchq` has none).
WORKER_EXTRA = ("torch", "transformers", "psutil", "prometheus_client")


def _flag_type(annotation: Any) -> tuple[type, tuple[str, ...] | None]:
    """The argparse type (and choices) of a setting from its annotation: X, X | None, Literal[...]."""
    args = [a for a in get_args(annotation) if a is not type(None)] or [annotation]
    if get_origin(annotation) is Literal:
        return str, tuple(get_args(annotation))
    inner = args[0]
    if get_origin(inner) is Literal:
        return str, tuple(get_args(inner))
    return inner, None


def _name_value(text: str) -> tuple[str, str]:
    """A NAME=VALUE flag (a mapping setting's entry, e.g. --lora sentiment=./adapters/sentiment)."""
    name, eq, value = text.partition("=")
    if not eq or not name or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE")
    return name, value


def _add_settings(p: argparse.ArgumentParser, title: str, fields: dict[str, FieldInfo]) -> None:
    """One flag per setting, named, typed and described by the config model itself."""
    group = p.add_argument_group(title)
    for name, info in fields.items():
        flag = "--" + name.replace("_", "-")
        help_ = info.description or ""
        if info.default_factory is None and info.default is not None:
            help_ = f"{help_} (default {info.default})" if help_ else f"default {info.default}"
        kind, choices = _flag_type(info.annotation)
        if get_origin(info.annotation) is dict:  # repeatable NAME=VALUE entries
            group.add_argument(flag, type=_name_value, action="append", default=None, metavar="NAME=PATH",
                               help=f"{help_} (repeatable)")  # fmt: skip
        elif kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            metavar = None if choices else name.split("_")[-1].upper()
            group.add_argument(flag, type=kind, choices=choices, default=None, metavar=metavar, help=help_)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="worker",
        description="batchq worker: pulls requests from a Redis (arq) queue and runs them on one model.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="TOML settings file (flags override it; see configs/worker.toml)")
    p.add_argument("--check", action="store_true", help="health probe: exit 0 if healthy, else 1")
    p.add_argument("-v", "--verbose", action="store_true")
    _add_settings(p, "engine settings", dict(EngineConfig.model_fields))
    worker_fields = {k: v for k, v in WorkerConfig.model_fields.items() if k != "engine"}
    _add_settings(p, "queue settings", worker_fields)
    return p


def _settings(ns: argparse.Namespace) -> dict[str, object]:
    out = {k: v for k, v in vars(ns).items() if k not in ("config", "check", "verbose")}
    # a mapping setting's NAME=VALUE entries (the last of a name wins, as for any flag)
    return {k: dict(v) if isinstance(v, list) else v for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if ns.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        cfg = load_config(ns.config, _settings(ns))
    except ConfigError as e:
        print(f"worker: {e}", file=sys.stderr)
        return 2
    if ns.check:
        return asyncio.run(_check(cfg, ns.worker_id))
    missing = [m for m in WORKER_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"worker: {', '.join(missing)} not installed: serving needs pip install 'batchq[worker]' "
            "(`pip install batchq` is the producer side)",
            file=sys.stderr,
        )
        return 1
    from worker.models.errors import ModelLoadError  # neither imports torch
    from worker.models.resolve import check_model_reference

    try:
        # Before torch, the model and Redis: a --model that names nothing loadable is refused at once.
        if not cfg.engine_stand_in:
            check_model_reference(cfg.engine.model)
    except ModelLoadError as e:
        print(f"worker: {e}", file=sys.stderr)
        return 2
    if cfg.data_parallel_size > 1:
        from worker.supervisor import supervise

        return supervise(cfg, list(sys.argv[1:] if argv is None else argv))
    return _serve(cfg)


def _serve(cfg: WorkerConfig) -> int:
    from worker.models.errors import ModelLoadError
    from worker.service import QueueBindingError, serve  # torch loads here, not for --help/--check

    try:
        return asyncio.run(serve(cfg))
    except ModelLoadError as e:  # a checkpoint that cannot be read: the user's input, like a bad setting
        logging.getLogger("batchq.worker").debug("model load failed", exc_info=True)
        print(f"worker: {e}", file=sys.stderr)
        return 2
    except QueueBindingError as e:
        print(f"worker: {e}", file=sys.stderr)
        return 1
    # Settings the engine refuses at load (a weight_dtype it cannot run, no room for the KV pool).
    except (ValueError, FileNotFoundError) as e:
        print(f"worker: {e}", file=sys.stderr)
        return 1


async def _check(cfg: WorkerConfig, worker_id: str | None) -> int:
    from producer.wire.redis_url import connect
    from worker.queue.health import check

    redis = connect(cfg.redis_url, socket_connect_timeout=3)
    try:
        ok, msg = await check(redis, cfg.queue, worker_id)
    except Exception as e:
        ok, msg = False, f"redis unreachable at {serde.mask_url(cfg.redis_url)} ({type(e).__name__})"
    finally:
        await redis.aclose()
    print(msg)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
