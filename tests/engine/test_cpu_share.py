"""CPU workers on shared machines: threads sized to the cgroup's CPU quota, and to the cores other processes
leave free (worker/platform/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest
from worker.engine_config import EngineConfig
from worker.platform.threads import CpuShare, cgroup_cpu_quota

ROOT = Path(__file__).resolve().parents[2]
CPUS = len(os.sched_getaffinity(0))


@contextmanager
def busy_core() -> Iterator[subprocess.Popen[bytes]]:
    """Another process that keeps one core busy, as a co-tenant does."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait()


def proposals(share: CpuShare, seconds: float) -> list[int]:
    """What `share` proposes while the caller's process stays busy, as an engine stepping would."""
    got, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        t = time.process_time() + 0.01
        while time.process_time() < t:
            pass
        if (n := share.poll()) is not None:
            got.append(n)
    return got


class Machine:
    """A /proc/stat the test writes, with clocks it advances: CpuShare's rule checked on loads the test
    chooses, whatever else the real machine runs."""

    HZ = os.sysconf("SC_CLK_TCK")

    def __init__(self, path: Path, cores: int) -> None:
        self.path, self.cores = path, cores
        self.now, self.own, self.readable = 100.0, 0.0, True
        self.busy = [0.0] * cores  # seconds each core was busy (user, system or stolen)
        self.write()

    def write(self) -> None:
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
        for c, busy in enumerate(self.busy):
            idle = max(0, int(self.now * self.HZ) - int(busy * self.HZ))
            # user nice system idle iowait irq softirq steal guest guest_nice: busy time split over user,
            # system and steal, as a shared VM's is (steal is another tenant's time too)
            b = int(busy * self.HZ)
            lines.append(f"cpu{c} {b - b // 2 - b // 4} 0 {b // 2} {idle} 3 0 0 {b // 4} 0 0")
        if self.readable:
            self.path.write_text("\n".join([*lines, "intr 12345", "ctxt 678"]) + "\n")

    def run(self, seconds: float, own: float, others: float) -> None:
        """`seconds` pass; this process uses `own` cores of them and other processes `others` cores."""
        self.now += seconds
        self.own += own * seconds
        per_core = (own + others) * seconds / self.cores
        self.busy = [b + per_core for b in self.busy]
        self.write()

    def share(self, budget: int, interval: float = 1.0) -> CpuShare:
        return CpuShare(
            budget, interval, str(self.path), cpus=range(self.cores), clock=lambda: self.now,
            own_cpu=lambda: self.own,
        )  # fmt: skip


def steps(machine: Machine, share: CpuShare, seconds: float, own: float, others: float) -> list[int]:
    """Proposals over `seconds` of engine steps (a quarter second each: binary fractions, so the clock lands
    on every interval's end exactly) beside `others` cores of other processes."""
    assert own + others <= machine.cores
    got = []
    for _ in range(round(seconds / 0.25)):
        machine.run(0.25, own, others)
        if (n := share.poll()) is not None:
            got.append(n)
    return got


def test_the_thread_count_follows_the_cores_other_processes_leave_free(tmp_path: Path) -> None:
    machine = Machine(tmp_path / "stat", cores=4)
    share = machine.share(4)
    assert steps(machine, share, 3.0, own=4, others=0) == [], "the engine's own time is not a co-tenant's"
    assert steps(machine, share, 3.0, own=3.8, others=0.2) == [], "a stray fifth of a core moves nothing"
    assert steps(machine, share, 1.0, own=3, others=1) == [], "one interval is a passing burst"
    assert steps(machine, share, 1.0, own=4, others=0) == []
    assert steps(machine, share, 3.0, own=3, others=1) == [3], "two intervals in a row agree"
    assert share.threads == 3
    assert steps(machine, share, 3.0, own=1, others=2.8) == [1]
    assert steps(machine, share, 3.0, own=0.1, others=3.9) == [], "never below one thread"
    assert steps(machine, share, 3.0, own=4, others=0) == [4], "a co-tenant's leaving gives the threads back"
    budget = machine.share(2)  # a budget below the cores (a cgroup quota) is never exceeded
    assert steps(machine, budget, 3.0, own=2, others=0.5) == []
    assert steps(machine, budget, 3.0, own=1, others=3) == [1]


def test_an_unreadable_stat_proposes_nothing(tmp_path: Path) -> None:
    machine = Machine(tmp_path / "stat", cores=2)
    share = machine.share(2)
    machine.readable = False
    machine.path.unlink()
    assert steps(machine, share, 3.0, own=1, others=1) == []


def others_load(seconds: float) -> float:
    """The cores other processes kept busy on this process's CPUs over `seconds` (this process idle)."""
    share = CpuShare(CPUS, interval=seconds)
    time.sleep(seconds)
    free = share.free_cores()
    assert free is not None
    return CPUS - free


def test_a_real_co_tenant_on_one_core_costs_the_engine_one_thread_and_its_leaving_gives_it_back() -> None:
    # The same rule on the real /proc/stat, with a real co-tenant process. It needs what it measures: two
    # cores, and none of them kept busy by anything else (a shared CI host's tenants show as busy time).
    if CPUS < 2:
        pytest.skip(f"needs two cores to share; this process may use {CPUS}")
    if (load := others_load(1.0)) > 0.3:
        pytest.skip(f"needs a quiet machine: other processes kept {load:.2f} cores busy before the test")
    share = CpuShare(CPUS, interval=0.5)
    with busy_core():
        assert proposals(share, 3.0)[:1] == [CPUS - 1]
    back = proposals(share, 3.0)[:1]
    if back != [CPUS] and (load := others_load(1.0)) > 0.3:
        pytest.skip(
            f"needs a quiet machine: other processes kept {load:.2f} cores busy after the co-tenant left"
        )
    assert back == [CPUS]


def test_the_engine_drops_a_thread_beside_a_co_tenant_and_keeps_an_explicit_setting(
    tiny_model_dir: Path,
) -> None:
    # an earlier engine's share may have lowered this process's threads beside other load: start from a
    # thread per core, as a new worker does
    before, threads = torch.get_num_threads(), CPUS
    if threads < 2:
        pytest.skip(f"needs two cores to drop a thread; this process may use {threads}")
    torch.set_num_threads(threads)
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_gb=0.05, repetition_window=0)
    assert Engine.load(cfg.model_copy(update={"num_threads": threads})).cpu_share is None
    engine = Engine.load(cfg)
    assert engine.cpu_share is not None and engine.cpu_share.budget == threads
    engine.cpu_share.interval = 0.5
    params = GenerationParams(max_new_tokens=100, temperature=0, ignore_eos=True)
    try:
        # With its own co-tenant beside it, the engine runs fewer threads than its budget, and exactly as
        # many as its share proposed (other load on the machine may take more than the one core it adds).
        with busy_core():
            deadline = time.monotonic() + 4.0
            while torch.get_num_threads() == threads and time.monotonic() < deadline:
                if not engine.has_work():
                    engine.add_request(EngineRequest(uuid.uuid4().hex, params, prompt_token_ids=[5, 6, 7]))
                engine.step()
            assert torch.get_num_threads() == engine.cpu_share.threads < threads
    finally:
        torch.set_num_threads(before)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_quota_is_the_tightest_of_the_cgroup_and_its_ancestors_in_either_cgroup_version(
    tmp_path: Path,
) -> None:
    v2, proc = tmp_path / "v2", tmp_path / "cgroup"
    write(v2 / "cgroup.controllers", "cpu memory\n")
    write(v2 / "kubepods" / "cpu.max", "400000 100000\n")  # the pod: 4 cores
    write(v2 / "kubepods" / "worker" / "cpu.max", "max 100000\n")  # the container: no limit of its own
    write(proc, "0::/kubepods/worker\n")
    assert cgroup_cpu_quota(str(proc), str(v2)) == 4.0
    write(v2 / "kubepods" / "worker" / "cpu.max", "150000 100000\n")
    assert cgroup_cpu_quota(str(proc), str(v2)) == 1.5
    write(proc, "0::/\n")  # inside a cgroup namespace: the mount is the process's own cgroup
    assert cgroup_cpu_quota(str(proc), str(v2)) is None

    v1 = tmp_path / "v1"
    write(v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "250000\n")
    write(v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    write(v1 / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    write(v1 / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    write(proc, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/docker/abc\n")
    assert cgroup_cpu_quota(str(proc), str(v1)) == 2.5
    assert cgroup_cpu_quota(str(tmp_path / "absent"), str(v1)) is None


def test_a_worker_in_a_cgroup_with_a_cpu_quota_sizes_its_threads_to_it(tiny_model_dir: Path) -> None:
    # A real cgroup with a quota of 1.5 cores, as Kubernetes' CPU limit makes one: the process still sees
    # every core, and must not start a thread per core.
    v1 = Path("/sys/fs/cgroup/cpu")
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.subtree_control").read_text():
        group, limit = v2 / f"batchq-test-{uuid.uuid4().hex[:8]}", ("cpu.max", "150000 100000")
    else:
        group, limit = v1 / f"batchq-test-{uuid.uuid4().hex[:8]}", ("cpu.cfs_quota_us", "150000")
    if not os.access(group.parent, os.W_OK):
        pytest.skip(f"needs a writable cgroup hierarchy at {group.parent} (root)")
    group.mkdir()
    try:
        (group / limit[0]).write_text(limit[1])
        code = (
            f"import os; open('{group}/cgroup.procs', 'w').write(str(os.getpid()));"
            "import torch; from worker.engine_config import EngineConfig; from worker.engine.engine import Engine;"
            f"e = Engine.load(EngineConfig(model={str(tiny_model_dir)!r}, dtype='float32', kv_cache_gb=0.05));"
            "print(torch.get_num_threads(), e.cpu_share.budget)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["1", "1"]
    finally:
        group.rmdir()
