"""How many threads the engine runs on a CPU: the cores its affinity mask and its cgroup's CPU quota allow
(`cpu_budget`), and of those, the ones other processes leave free (`CpuShare`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

# A container's CPU limit (Kubernetes `resources.limits.cpu`, docker --cpus) is a CFS quota on its
# cgroup, not an affinity mask: the process still sees every core of the node, and OpenMP starts a thread
# per core. Those threads then spend the quota together and are throttled together, and each fork/join
# waits on whichever thread the throttle caught. Sizing the thread count to the quota avoids that.


def cgroup_cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """The tightest CFS quota, in cores, on this process's cgroup or any of its ancestors (cgroup v2
    `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`); None when there is none or nothing is readable."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:  # v2: one hierarchy, mounted at root or root/unified
            base = Path(root) if (Path(root) / "cgroup.controllers").exists() else Path(root) / "unified"
            for d in _cgroup_dirs(base, path):
                quotas += _v2_quota(d / "cpu.max")
        elif "cpu" in controllers.split(","):
            base = Path(root) / controllers
            if not base.is_dir():
                base = Path(root) / "cpu"
            for d in _cgroup_dirs(base, path):
                quotas += _v1_quota(d / "cpu.cfs_quota_us", d / "cpu.cfs_period_us")
    return min(quotas) if quotas else None


def _cgroup_dirs(base: Path, path: str) -> list[Path]:
    """The cgroup's directory and its ancestors up to the mount. Inside a cgroup namespace the path is "/"
    (the mount is the process's own cgroup); a path the mount does not hold names a cgroup of another
    namespace, and only the mount's own limits can be read."""
    own = base / path.strip("/")
    if not own.is_dir():
        return [base] if base.is_dir() else []
    dirs = [own]
    while dirs[-1] != base:
        dirs.append(dirs[-1].parent)
    return dirs


def _v2_quota(cpu_max: Path) -> list[float]:
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return []
    return [] if quota == "max" else [int(quota) / int(period)]


def _v1_quota(quota_file: Path, period_file: Path) -> list[float]:
    try:
        quota, period = int(quota_file.read_text()), int(period_file.read_text())
    except (OSError, ValueError):
        return []
    return [quota / period] if quota > 0 and period > 0 else []


def affinity() -> list[int]:
    """The CPUs this process may run on (empty where the OS does not say)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def cpu_budget() -> int:
    """The cores this process may use at once: its affinity mask, cut to its cgroup's CPU quota (rounded
    down: a thread per fractional core would only be throttled)."""
    cores = len(affinity()) or os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cores, int(quota))) if quota is not None else cores


# Every CPU step is many OpenMP fork/joins, and each join waits for the slowest thread. With a thread per
# core and another process busy on one of them, the thread that shares that core arrives late at every
# join, and the whole step runs at the pace of its time slices (benchmarks/cotenant_bench.py). One thread
# fewer runs undisturbed on the cores that are free. So the engine watches how much of its cores other
# processes use and runs as many threads as they leave free, up to its budget.


class CpuShare:
    """Proposes the engine's thread count from the CPU time other processes take on this process's cores:
    per-core busy time from /proc/stat minus this process's own CPU time, over `interval` seconds. A new
    count is proposed only when two intervals in a row agree, so a passing burst moves nothing.

    `stat`, `cpus`, `clock` and `own_cpu` default to the machine's own; tests pass a /proc/stat they write
    and clocks they advance, so the rule can be checked whatever else the machine runs."""

    def __init__(
        self,
        budget: int,
        interval: float = 1.0,
        stat: str = "/proc/stat",
        *,
        cpus: Sequence[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        own_cpu: Callable[[], float] = time.process_time,
    ) -> None:
        self.budget, self.interval, self.stat = budget, interval, stat
        self.cpus = list(cpus) if cpus is not None else affinity()
        self.clock, self.own_cpu = clock, own_cpu
        self.threads = budget
        self._last = self._sample()
        self._pending: int | None = None

    def _sample(self) -> tuple[float, float, float] | None:
        """(monotonic time, busy seconds of this process's cores, this process's CPU seconds)."""
        try:
            text = open(self.stat, "rb").read().decode()  # noqa: SIM115 (one read, hot enough to skip Path)
        except OSError:
            return None
        wanted, busy = {f"cpu{c}" for c in self.cpus}, 0
        for line in text.splitlines():
            name, *fields = line.split()
            if name in wanted:
                # user nice system idle iowait irq softirq steal: time not idle is someone's, steal too
                ticks = [int(f) for f in fields[:8]]
                busy += sum(ticks) - ticks[3] - ticks[4]
        return self.clock(), busy / os.sysconf("SC_CLK_TCK"), self.own_cpu()

    def free_cores(self) -> float | None:
        """The cores other processes left free since the last call; None before `interval` has passed."""
        # Sampling is not free for the busy threads (the kernel gathers every thread's CPU time, and a step
        # reading it each time decoded visibly slower): once per interval only.
        if self._last is None or self.clock() - self._last[0] < self.interval:
            return None
        now = self._sample()
        if now is None:
            return None
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        self._last = now
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)
        return len(self.cpus) - others

    def poll(self) -> int | None:
        """A new thread count when the engine should change, else None. Cheap between intervals."""
        free = self.free_cores()
        if free is None or not self.cpus:
            return None
        # A core counts as free when most of it is: a co-tenant's stray quarter core is no reason to drop
        # a thread, a co-tenant's whole core is.
        target = max(1, min(self.budget, int(free + 0.3)))
        if target == self.threads:
            self._pending = None
            return None
        if self._pending != target:
            self._pending = target
            return None
        self.threads, self._pending = target, None
        return target
