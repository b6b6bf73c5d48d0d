"""`worker --data-parallel-size M`: M engine groups on one machine, each a worker process of its own on
`tensor_parallel_size` GPUs, under this supervisor.

Each group claims from the queue for itself: a worker's queue path costs about 0.4 ms of its CPU per
request and one Redis core carries about 20,000 requests/s (benchmarks/queue_bench.py), far above what M
engine groups answer, so a shared claimer would save nothing and would put one more process between every
request and its engine. Each group is then a whole worker: its own heartbeat (worker id `<id>-dp<i>`, so
`producer workers`, the metrics and the console list each group), its own leases, and its own metrics port
(metrics_port + i).

A group that exits for any reason but the supervisor's SIGTERM is started again after a backoff that
doubles from 1 s to 60 s (and resets once a group has run for 5 minutes). SIGTERM or SIGINT goes to every
group, which drains as a lone worker does; the supervisor exits 0 once every group has. The groups die
with the supervisor however it ends (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from worker.config import WorkerConfig

log = logging.getLogger(__name__)

BACKOFF_S = (1.0, 60.0)  # the first restart's wait, and the longest
HEALTHY_S = 300.0  # a group that ran this long starts its backoff afresh


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def visible_gpus(cfg: WorkerConfig) -> list[str]:
    """The GPUs the groups share out: --gpus, else CUDA_VISIBLE_DEVICES, else every device torch sees."""
    if cfg.gpus:
        return [g.strip() for g in cfg.gpus.split(",") if g.strip()]
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def group_gpus(cfg: WorkerConfig) -> list[list[str]] | None:
    """Each group's GPUs (None on a CPU: the groups share the cores). Raises ValueError when there are too
    few."""
    if cfg.engine.device == "cpu":
        return None
    gpus = visible_gpus(cfg)
    per, groups = cfg.engine.tensor_parallel_size, cfg.data_parallel_size
    if not gpus and cfg.engine.device == "auto":
        return None
    if len(gpus) < per * groups:
        raise ValueError(
            f"data_parallel_size {groups} x tensor_parallel_size {per} needs {per * groups} GPUs; "
            f"{len(gpus)} are visible ({','.join(gpus) or 'none'})"
        )
    return [gpus[i * per : (i + 1) * per] for i in range(groups)]


@dataclass
class Group:
    index: int
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restarts: int = 0
    wait_s: float = field(default=BACKOFF_S[0])
    due: float = 0.0  # when a dead group starts again

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, preexec_fn=_die_with_parent)
        self.started = time.monotonic()
        gpus = self.env.get("CUDA_VISIBLE_DEVICES")
        log.info(
            "group %d: started (pid %d)%s", self.index, self.proc.pid, f" on GPUs {gpus}" if gpus else ""
        )

    def tend(self, now: float) -> None:
        """Start the group again once its backoff has passed, or notice that it ended."""
        if self.proc is None:
            if now >= self.due:
                self.start()
            return
        code = self.proc.poll()
        if code is None:
            return
        if now - self.started >= HEALTHY_S:
            self.wait_s = BACKOFF_S[0]
        self.proc, self.due, self.restarts = None, now + self.wait_s, self.restarts + 1
        log.error("group %d exited with status %d: starting it again in %.0fs (restart %d)", self.index,
                  code, self.wait_s, self.restarts)  # fmt: skip
        self.wait_s = min(BACKOFF_S[1], self.wait_s * 2)


def groups(cfg: WorkerConfig, argv: list[str]) -> list[Group]:
    """One worker command per group: this command's flags, then its own id, metrics port and GPUs."""
    gpus = group_gpus(cfg)
    out = []
    for i in range(cfg.data_parallel_size):
        own = [*argv, "--data-parallel-size", "1", "--worker-id", f"{cfg.worker_id}-dp{i}"]
        if cfg.metrics_port:
            own += ["--metrics-port", str(cfg.metrics_port + i)]
        env = dict(os.environ)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i])
        out.append(Group(i, [sys.executable, "-m", "worker.cli", *own], env))
    return out


def supervise(cfg: WorkerConfig, argv: list[str]) -> int:
    """Run the groups until SIGTERM / SIGINT; -> 0 once every group has drained."""
    try:
        members = groups(cfg, argv)
    except ValueError as e:
        print(f"worker: {e}", file=sys.stderr)
        return 2
    stopping: list[int] = []

    def on_signal(sig: int, _frame: object) -> None:
        if not stopping:
            log.info("%s: every group drains, then exits", signal.Signals(sig).name)
        stopping.append(sig)
        for g in members:
            if g.proc is not None and g.proc.poll() is None:
                g.proc.send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    for g in members:
        g.start()
    log.info("%d data-parallel groups of %d rank(s) each", len(members), cfg.engine.tensor_parallel_size)
    while True:
        if stopping:
            codes = [g.proc.wait() if g.proc is not None else 0 for g in members]
            log.info("every group stopped (%s)", ", ".join(map(str, codes)))
            return 0
        for g in members:
            g.tend(time.monotonic())
        time.sleep(0.2)
