"""`worker`: serve one model on one queue, or `worker --check` for a health probe."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from producer import serde
from worker.config import WorkerConfig, load_config

EPILOG = """\
examples:
  worker --model smollm2-135m
  worker --model ./my-llama-checkpoint --queue llama --device cuda --kv-watermark 0.85
  worker --config configs/worker.toml --redis-url rediss://user:secret@redis.example:6380/0
  worker --check --queue llama        # exit 0 if a live, progressing worker serves the queue here

exit status: 0 normal stop, 1 failed check / start-up error, 2 bad arguments or config, 70 stalled engine
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="worker",
        description="batchq worker: pulls requests from a Redis (arq) queue and runs them on one model.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", help="HF checkpoint dir, .gguf file, hub id, or alias 'smollm2-135m'")
    p.add_argument("--config", help="TOML settings file (flags override it)")
    p.add_argument("--redis-url", help="default: $REDIS_URL or redis://127.0.0.1:6379/0")
    p.add_argument("--queue", help="queue name (one model per queue); default 'default'")
    p.add_argument("--worker-id", help="default: HOSTNAME:PID")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-watermark", type=float, help="fraction of free GPU memory for the KV pool (0.9)")
    p.add_argument("--kv-cache-gb", type=float, help="explicit KV pool size in GB (CPU default 1.0)")
    p.add_argument("--block-size", type=int)
    p.add_argument("--max-num-seqs", type=int, help="max sequences decoded together")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget per step")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"])
    p.add_argument("--repetition-window", type=int, help="loop detection window in tokens (10; 0 = off)")
    p.add_argument(
        "--repetition-repeats", type=int, help="windows repeated in a row that end a loop (3; 0 = off)"
    )
    p.add_argument("--prefetch", type=int, help="requests held beyond max-num-seqs (default max-num-seqs/2)")
    p.add_argument("--lease-s", type=float, help="lease on a running request; renewed while alive (30)")
    p.add_argument("--max-tries", type=int, help="tries before a request fails with an error (3)")
    p.add_argument("--shutdown-grace-s", type=float, help="SIGTERM: time to finish in-flight work (30)")
    p.add_argument("--stall-s", type=float, help="exit with status 70 after this long without progress (300)")
    p.add_argument("--heartbeat-s", type=float)
    p.add_argument("--log-interval-s", type=float)
    p.add_argument("--result-ttl-s", type=float, help="how long results are kept (7 days)")
    p.add_argument("--burst", action="store_true", default=None, help="exit once the queue is empty")
    p.add_argument("--check", action="store_true", help="health probe: exit 0 if healthy, else 1")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def _overrides(ns: argparse.Namespace) -> dict[str, object]:
    skip = {"config", "check", "verbose"}
    return {k: v for k, v in vars(ns).items() if k not in skip}


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if ns.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # arq logs each job's arguments (our prompts) at INFO: keep it to warnings.
    logging.getLogger("arq").setLevel(logging.WARNING)
    try:
        config_path = ns.config
        if config_path is None and Path("configs/worker.toml").is_file() and ns.model is None:
            config_path = "configs/worker.toml"
        cfg = load_config(config_path, _overrides(ns))
    except (ValueError, TypeError) as e:
        print(f"worker: {e}", file=sys.stderr)
        return 2
    if ns.check:
        return asyncio.run(_check(cfg, ns.worker_id))
    return _serve(cfg)


def _serve(cfg: WorkerConfig) -> int:
    from worker.service import QueueBindingError, serve  # torch loads here, not for --help/--check

    try:
        return asyncio.run(serve(cfg))
    except QueueBindingError as e:
        print(f"worker: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:  # bad model path / unsupported architecture
        print(f"worker: {e}", file=sys.stderr)
        return 1


async def _check(cfg: WorkerConfig, worker_id: str | None) -> int:
    from redis.asyncio import Redis

    from worker.health import check

    redis = Redis.from_url(cfg.redis_url, socket_connect_timeout=3)
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
