"""Tensor parallelism's ranks on one machine. Rank 0 is the engine's own process: it runs the scheduler,
sampler, grammars and stop rules, and its model is a `ShardedModel`, which sends every call to the other
ranks (each a process started here, `python -m worker.engine.tensor_parallel`) before running it on its own
share. The ranks run the same call on theirs; the collectives inside the model join the shares.

A rank process dies with the engine's (PR_SET_PDEATHSIG), and ends when the engine stops the group.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, cast

import torch

from worker.engine.assembly import build_model
from worker.engine.kv_pool import copy_kv_blocks
from worker.engine_config import EngineConfig
from worker.kernels.backend import Backend, torch_backend
from worker.models.layers import AttentionMetadata, KVCache
from worker.models.llama import LlamaFamilyModel
from worker.models.loader import LoadedModel
from worker.parallel.group import GroupFailure, TPGroup, dtype_name, dtype_named, free_port
from worker.platform import Dtypes, Platform, load_platform

log = logging.getLogger(__name__)

CONFIG_ENV = "BATCHQ_RANK_ENGINE_CONFIG"  # the engine's settings, as JSON, for its rank processes
WATCH_INTERVAL_S = 0.5  # how often rank 0 looks at its rank processes


def _die_with_parent() -> None:
    """In the rank process, before it runs: SIGKILL when the engine's process ends, however it ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start_ranks(cfg: EngineConfig, platform: Platform) -> tuple[TPGroup, list[subprocess.Popen[bytes]]]:
    """Start ranks 1..N-1 of the engine's group and join it as rank 0; -> the group, the rank processes."""
    size, port = cfg.tensor_parallel_size, free_port()
    env = {**os.environ, CONFIG_ENV: cfg.model_dump_json()}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "worker.engine.tensor_parallel", str(rank), str(size), str(port)],
            env=env,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        for rank in range(1, size)
    ]
    try:
        group = TPGroup.connect(0, size, port, platform.device, _timeout(cfg))
    except BaseException:
        stop_ranks(procs, 0)
        raise
    log.info("tensor parallelism: %d ranks (pids %s beside this one's)", size, [p.pid for p in procs])
    return group, procs


def load_sharded(
    cfg: EngineConfig, platform: Platform, dtypes: Dtypes
) -> tuple[LoadedModel, Dtypes, Backend]:
    """Rank 0's part of Engine.load under tensor parallelism: the other ranks started, its own share loaded
    (build_model) while they load theirs, and its model a ShardedModel once every rank has loaded."""
    group, procs = start_ranks(cfg, platform)
    try:
        loaded, dtypes, backend = build_model(cfg, platform, dtypes, group)
        group.barrier("loading the model's shares")
    except BaseException:
        stop_ranks(procs, 0)
        raise
    assert isinstance(loaded.model, LlamaFamilyModel)
    loaded.model = cast(Any, ShardedModel(loaded.model, group, backend, procs))
    return loaded, dtypes, backend


def _timeout(cfg: EngineConfig) -> datetime.timedelta:
    return datetime.timedelta(seconds=cfg.collective_timeout_s)


def stop_ranks(procs: list[subprocess.Popen[bytes]], timeout: float = 10.0) -> None:
    """End the rank processes: each has `timeout` seconds to exit on its own (after a `stop` command), then
    is killed."""
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class ShardedModel:
    """Rank 0's model of a tensor-parallel group: its own share (`local`, whose attributes it shows), each
    call sent first to the other ranks, which make the same call on theirs. `backend`: the engine's (a call
    with another, the KV pool's sizing probe's torch backend, is made with that one on every rank)."""

    def __init__(self, local: LlamaFamilyModel, group: TPGroup, backend: Backend, procs: list[Any]) -> None:
        self.local, self.group, self.backend, self.procs = local, group, backend, procs
        self.pool: list[KVCache] | None = None
        # why the group cannot go on (a rank process ended), seen by the watchdog between steps as well
        self.failure: str | None = None
        self._closing = False
        threading.Thread(target=self._watch, name="batchq-tp-watchdog", daemon=True).start()

    def _watch(self) -> None:
        """Notice a rank process that ends, at once, even while the engine is idle."""
        while not self._closing:
            for rank, p in enumerate(self.procs, start=1):
                code = p.poll()
                if code is not None and not self._closing:
                    self.failure = f"tensor-parallel rank {rank} (pid {p.pid}) exited with status {code}"
                    log.error("%s: the group cannot go on", self.failure)
                    return
            time.sleep(WATCH_INTERVAL_S)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_caches: list[KVCache], backend: Backend,
    ) -> torch.Tensor:  # fmt: skip
        k = kv_caches[0][0]
        kv: Any = "pool" if kv_caches is self.pool else {"shape": list(k.shape), "dtype": dtype_name(k.dtype)}
        tensors = [input_ids, positions]
        header = {"op": "forward", "kv": kv, "own": backend is self.backend, "meta": pack_meta(meta, tensors)}
        self.group.send_command(header, tensors)
        hidden: torch.Tensor = self.local(input_ids, positions, meta, kv_caches, backend)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.group.send_command({"op": "logits"}, [hidden])
        return self.local.compute_logits(hidden)

    def kv_absmax(self, *args: Any) -> Any:
        raise ValueError("kv_cache_dtype fp8_e4m3 under tensor parallelism: its calibration is not shared "
                         "over the ranks yet; use kv_cache_dtype = 'auto'")  # fmt: skip

    def attach_pool(self, kv_caches: list[KVCache]) -> None:
        """The engine's KV pool: every rank allocates its own of the same shape (its KV heads)."""
        self.pool = kv_caches
        k = kv_caches[0][0]
        header = {
            "op": "pool",
            "shape": list(k.shape),
            "dtype": dtype_name(k.dtype),
            "layers": len(kv_caches),
        }
        self.group.send_command(header)

    def copy_blocks(self, axis: int, copies: list[tuple[int, int]]) -> None:
        self.group.send_command({"op": "copy", "axis": axis, "copies": [list(c) for c in copies]})

    def close(self) -> None:
        """Stop the other ranks (they leave their loop and exit; any that does not is killed)."""
        self._closing = True
        try:
            if self.failure is None:
                self.group.send_command({"op": "stop"})
        except GroupFailure:
            pass  # a rank is gone already: the others are killed below
        finally:
            stop_ranks(self.procs, 10.0 if self.failure is None else 0.0)


@torch.inference_mode()
def serve(group: TPGroup, model: LlamaFamilyModel, backend: Backend) -> None:
    """A rank's loop: rank 0's commands, run on this rank's share, until `stop`."""
    pool: list[KVCache] | None = None
    device = model.lm_head.weight.device

    def caches(shape: list[int], dtype: str, layers: int, make: Any) -> list[KVCache]:
        return [(make(shape, dtype=dtype_named(dtype), device=device),
                 make(shape, dtype=dtype_named(dtype), device=device)) for _ in range(layers)]  # fmt: skip

    while True:
        command, tensors = group.receive_command(device)
        op = command["op"]
        if op == "forward":
            ids, positions = tensors[:2]
            kv = command["kv"]
            if kv == "pool":
                assert pool is not None
                step_caches = pool
            else:
                step_caches = caches(kv["shape"], kv["dtype"], len(model.layers), torch.zeros)
            meta = unpack_meta(command["meta"], tensors)
            model(ids, positions, meta, step_caches, backend if command["own"] else torch_backend())
        elif op == "logits":
            model.compute_logits(tensors[0])
        elif op == "pool":
            pool = caches(command["shape"], command["dtype"], command["layers"], torch.empty)
        elif op == "copy":
            assert pool is not None
            copy_kv_blocks(pool, command["axis"], [(a, b) for a, b in command["copies"]])
        elif op == "stop":
            return
        else:
            raise ValueError(f"rank {group.rank}: unknown command {op!r}")


def pack_meta(meta: AttentionMetadata, tensors: list[torch.Tensor]) -> dict[str, Any]:
    """`meta` as a command's JSON: its tensors appended to `tensors`, named by their index there."""

    def index(t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        tensors.append(t)
        return len(tensors) - 1

    return {
        "phase": meta.phase,
        "slot_mapping": index(meta.slot_mapping),
        "block_tables": index(meta.block_tables),
        "context_lens": index(meta.context_lens),
        "cu_seqlens_q": index(meta.cu_seqlens_q),
        "decode": None if meta.decode is None else pack_meta(meta.decode, tensors),
    }


def unpack_meta(packed: dict[str, Any], tensors: list[torch.Tensor]) -> AttentionMetadata:
    """pack_meta's inverse, over the tensors that came with the command."""
    cu = packed["cu_seqlens_q"]
    return AttentionMetadata(
        phase=packed["phase"],
        slot_mapping=tensors[packed["slot_mapping"]],
        block_tables=tensors[packed["block_tables"]],
        context_lens=tensors[packed["context_lens"]],
        cu_seqlens_q=None if cu is None else tensors[cu],
        decode=None if packed["decode"] is None else unpack_meta(packed["decode"], tensors),
    )


def rank_main(rank: int, size: int, port: int, cfg: EngineConfig) -> None:
    """One rank other than 0: the platform, dtypes and backend as rank 0 chose them (the same settings and
    kept probes on the same machine), its share of the model, then rank 0's commands."""
    # The engine's process drains and then stops the group: a signal meant for the whole process group (a
    # terminal's Ctrl-C) must not end a rank under it.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if cfg.device != "cpu" and torch.cuda.is_available():
        torch.cuda.set_device(rank)  # a GPU each: rank r on the r-th visible device
    platform = load_platform(cfg.device)
    platform.prepare(cfg)
    dtypes: Dtypes = platform.dtypes(cfg)
    group = TPGroup.connect(rank, size, port, platform.device, _timeout(cfg))
    loaded, _, backend = build_model(cfg, platform, dtypes, group)
    assert isinstance(loaded.model, LlamaFamilyModel)
    group.barrier("loading the model's shares")
    serve(group, loaded.model, backend)


def main() -> None:
    p = argparse.ArgumentParser(description="one rank of a tensor-parallel engine (started by the engine)")
    p.add_argument("rank", type=int)
    p.add_argument("size", type=int)
    p.add_argument("port", type=int)
    ns = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format=f"rank {ns.rank}: %(levelname)s %(name)s: %(message)s")
    cfg = EngineConfig.model_validate_json(os.environ[CONFIG_ENV])
    rank_main(ns.rank, ns.size, ns.port, cfg)


if __name__ == "__main__":
    main()
