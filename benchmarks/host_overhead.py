"""The engine's host cost per decoding sequence per step, on a model whose own compute is small.

    .venv/bin/python benchmarks/host_overhead.py                 # the tables (the overlap's at D = 5 ms)
    .venv/bin/python benchmarks/host_overhead.py --profile       # + cProfile's top 25 at N=256
    .venv/bin/python benchmarks/host_overhead.py --sample        # seeded sampling in place of greedy
    .venv/bin/python benchmarks/host_overhead.py --graphs --prompt-len 512   # the CUDA-graph path's host work

A random Llama of 1 layer, hidden size 32 (2 heads of 16, one kv head: the C decode kernels' shapes, so a
decode step is one decode_stack.c call) with SmolLM2's byte-level BPE tokenizer and its vocabulary of
49,152 (the stop rules detokenise real token ids: multi-byte characters, special tokens), one thread.
N requests (64, 256, 512) of random 16-token prompts decode together, every one of them for the whole run:
greedy (--sample: seeded sampling at temperature 1), ignore_eos, a long max_new_tokens, the default
repetition rule (10 tokens x 3: --warmup's 30 steps give every sequence those 30 tokens before the timed
steps, so the rule's check runs whole; the model does not loop that early); half of them carry stop strings
(that never match) so the stop-string search runs. After the prompts and the warm-up steps, --steps decode steps are timed, best of --repeats runs.

A vocabulary of 49,152 is not free: the LM head and the sampler's argmax (its softmax and cumsums with
--sample) cost about as much per sequence as the host does. So each step is split: the decoder's forward
(model.forward), the LM head (model.compute_logits), the sampler (Sampler.__call__), and the host: the rest
of the step (intake, scheduling, block tables, input packing, stop rules, detokenising, results).

The table: ms per step at each N, in all and the host's part, and the line through N=64 and N=512: its
slope, microseconds per sequence per step ((t512 - t64) / (448 * steps), counting a sequence the
repetition rule ended early out of the steps after), and its intercept, the fixed ms per step.

--graphs: the same through the CUDA-graph path (a GPU's default), its replays standing in for graphs as the
eager forward over the graph runner's static buffers (CudaGraphRunner(capture=False)): the host's part is
then what a GPU's host would do around each replay. Its staging grows with the block tables' width, so
--prompt-len sets the context (16 tokens by default).

The second table (--device-ms D, 5 by default; 0: none) is the overlap of the host's work with the device's (EngineConfig.async_scheduling). A stand-in
device: the model's forward pass, LM head and sampler take D ms together, waiting without holding the
GIL (as a GPU's step leaves the host free), on deterministic logits over the first 1,024 ids (a fixed
random table's row, picked by the input token and its position). The same requests run serially and overlapped; the table is ms per step against
D: serially a step takes D + the host's work, overlapped about max(D, the host's work).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = (64, 256, 512)
PROMPT_LEN = 16
STOP = ("<<never-stop>>", "\u00a7\u00a7\u00a7")  # stop strings of half the requests (never produced)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def build_checkpoint(path: Path) -> Path:
    """tests/tiny_models' random Llama at 1 layer, hidden 32, with SmolLM2's tokenizer and vocabulary size."""
    from transformers import AutoTokenizer

    from tests.tiny_models import build_tiny_checkpoint
    from worker.models.resolve import resolve_checkpoint

    source = Path(resolve_checkpoint("smollm2-135m"))
    vocab = len(AutoTokenizer.from_pretrained(source))
    build_tiny_checkpoint(
        path,
        "llama",
        seed=0,
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,  # head_dim 16: paged_decode.c's (a multiple of 16)
        num_key_value_heads=1,
        max_position_embeddings=4096,
    )
    for name in TOKENIZER_FILES:  # the byte tokenizer's files out, SmolLM2's in
        (path / name).unlink(missing_ok=True)
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    assert len(AutoTokenizer.from_pretrained(path)) == vocab
    return path


def where() -> str:
    """The commit (and whether the tree differs from it) and the machine."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=no")
        commit = git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    from bench import cpu_name

    return f"commit {commit}; {cpu_name()}, {os.cpu_count()} cores; Python {platform.python_version()}"


PARTS = ("forward", "lm_head", "sampler")  # timed apart from the host's part of a step


def add_requests(engine: Any, n: int, max_new_tokens: int, sample: bool) -> None:
    import torch

    from worker.engine.params import GenerationParams
    from worker.engine.request import EngineRequest

    gen = torch.Generator().manual_seed(n)
    vocab = len(engine.tokenizer)
    for i in range(n):
        ids = torch.randint(100, vocab, (PROMPT_LEN,), generator=gen).tolist()
        params = GenerationParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if sample else 0.0,
            seed=1000 * n + i,
            ignore_eos=True,
            stop=STOP if i % 2 else (),
        )
        engine.add_request(EngineRequest(f"n{n}-{i}", params, prompt_token_ids=ids))


def start_decoding(engine: Any, n: int, max_new_tokens: int, warmup: int, sample: bool) -> Any:
    """Add the n requests, run their prompts and `warmup` decode steps: every sequence decoding from here
    on. -> the engine's scheduler."""
    add_requests(engine, n, max_new_tokens, sample)
    sched = engine.scheduler
    while engine.stats().waiting or not all(s.prefilled for s in sched.running):
        engine.step()
    for _ in range(warmup):
        engine.step()
    return sched


class Timers:
    """Seconds spent in the model's forward, its LM head and the sampler while `on` (instance attributes
    over the methods the model runner calls)."""

    def __init__(self, engine: Any) -> None:
        self.on = False
        self.seconds = dict.fromkeys(PARTS, 0.0)
        runner = engine.model_runner
        model = runner.model
        self._wrap(model, "forward", "forward")
        self._wrap(model, "compute_logits", "lm_head")
        self._wrap(runner, "sampler", "sampler")

    def _wrap(self, owner: Any, attr: str, part: str) -> None:
        inner = getattr(owner, attr)

        def timed(*a: Any, **k: Any) -> Any:
            if not self.on:
                return inner(*a, **k)
            t = time.perf_counter()
            out = inner(*a, **k)
            self.seconds[part] += time.perf_counter() - t
            return out

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)


def run(
    engine: Any,
    timers: Timers,
    n: int,
    steps: int,
    warmup: int,
    sample: bool,
    profile: cProfile.Profile | None = None,
) -> dict[str, float]:
    """Seconds of `steps` decode steps at `n` decoding sequences: "total", and each of PARTS; "seq_steps",
    the sequences decoded summed over the steps (n * steps, less what a sequence ending in a loop left)."""
    from worker.engine.request import EngineError

    # (room for the tokens the first requests decode while the others' prompts run, chunk by chunk)
    sched = start_decoding(engine, n, 2 * (steps + warmup) + 8, warmup, sample)
    timers.reset()
    timers.on = True
    seq_steps = 0
    if profile is not None:
        profile.enable()
    t = time.perf_counter()
    for _ in range(steps):
        seq_steps += len(sched.running)
        engine.step()
    total = time.perf_counter() - t
    if profile is not None:
        profile.disable()
    timers.on = False
    # the repetition rule may end a sequence whose greedy path loops: the few that do are counted out
    assert seq_steps >= 0.95 * n * steps, f"{n * steps - seq_steps} of {n * steps} sequence-steps missing"
    engine.abort_all(EngineError("cancelled", "measured"))
    return {"total": total, **timers.seconds, "seq_steps": seq_steps}


STAND_IN_VOCAB = 1024  # the stand-in device's logits: the first ids of the vocabulary
STAND_IN_ROWS = 4099  # rows of its table (a prime: (token, position) pairs spread over them)


def stand_in_device(engine: Any, ms: float) -> None:
    """Replace the engine's model by the stand-in device (--device-ms): a forward pass, its logits and the
    sampling from them take `ms` together (a GPU's step, sampler included), waiting (time.sleep releases the
    GIL) for what the table lookup and the sampler leave of them; the logits are a fixed random table's row
    per (input token, position)."""
    import torch

    table = torch.randn(STAND_IN_ROWS, STAND_IN_VOCAB, generator=torch.Generator().manual_seed(0))
    runner = engine.model_runner
    model, sampler = runner.model, runner.sampler
    began = [0.0]

    def forward(input_ids: Any, positions: Any, *_: Any) -> Any:
        began[0] = time.perf_counter()
        return ((input_ids * 31 + positions) % STAND_IN_ROWS).unsqueeze(1)  # [T, 1]: the table's row

    def compute_logits(hidden: Any) -> Any:
        return table.index_select(0, hidden.squeeze(1))

    def sample(logits: Any, batch: Any) -> Any:
        tokens = sampler(logits, batch)
        time.sleep(max(0.0, began[0] + ms / 1e3 - time.perf_counter()))
        return tokens

    model.forward = forward
    model.compute_logits = compute_logits
    runner.sampler = sample


def overlap(engine: Any, n: int, steps: int, warmup: int, sample: bool) -> tuple[float, list[list[int]]]:
    """ms per step of `steps` decode steps at n sequences (after the prompts and `warmup` steps), and the
    tokens every sequence generated (the serial and overlapped engines' must agree)."""
    from worker.engine.request import EngineError

    start_decoding(engine, n, steps + warmup + 8, warmup, sample)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    ms = (time.perf_counter() - t) / steps * 1e3
    results = engine.abort_all(EngineError("cancelled", "measured"))
    tokens = [r.token_ids for r in sorted(results, key=lambda r: r.request_id)]
    return ms, tokens


def print_profile(prof: cProfile.Profile, steps: int, n: int) -> None:
    print(
        f"\ncProfile, {steps} steps at N={n}: top 25 by tottime (us/seq/step = tottime / steps / N; the profiler"
    )
    print("inflates small functions' times, several-fold for the host's: read the order, not the sizes)")
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]  # type: ignore[attr-defined]
    print(f"{'us/seq/step':>11} {'tottime s':>9} {'cumtime s':>9} {'calls':>9}  function")
    for (file, line, fn), (_cc, calls, tt, ct, _) in rows:
        name = f"{Path(file).name}:{line}({fn})" if line else fn
        print(f"{tt / steps / n * 1e6:>11.2f} {tt:>9.4f} {ct:>9.4f} {calls:>9}  {name}")


def main() -> int:
    global PROMPT_LEN  # --prompt-len: add_requests' too
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per run")
    p.add_argument("--warmup", type=int, default=30, help="decode steps before the timed ones")
    p.add_argument("--repeats", type=int, default=3, help="runs per size; the fastest (by host time) counts")
    p.add_argument("--sample", action="store_true", help="seeded sampling at temperature 1 (default: greedy)")
    p.add_argument("--profile", action="store_true", help="cProfile's top 25 by tottime at N=256")
    p.add_argument("--graphs", action="store_true", help="through the CUDA-graph path, its replays eager")
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help="tokens of each request's prompt")
    p.add_argument("--checkpoint", type=Path, help="reuse (or build once in) this folder")
    p.add_argument(
        "--device-ms",
        type=float,
        default=5.0,
        help="the overlap table's stand-in device: D ms a step (0: no table)",
    )
    ns = p.parse_args()

    from worker.engine.engine import Engine
    from worker.engine_config import EngineConfig

    PROMPT_LEN = ns.prompt_len
    with tempfile.TemporaryDirectory() as tmp:
        path = ns.checkpoint or Path(tmp) / "tiny-llama-smollm2-vocab"
        if not (path / "config.json").exists():
            build_checkpoint(path)
        cfg = EngineConfig(
            model=str(path),
            device="cpu",
            num_threads=1,
            max_num_seqs=max(SIZES),
            max_num_batched_tokens=min(max(SIZES) * PROMPT_LEN, 32768),
            max_model_len=max(512, PROMPT_LEN + 2 * (ns.steps + ns.warmup) + 16),
            prefix_cache=False,
            # the host's work is measured serially (the overlap hides it behind the model's, the table after)
            async_scheduling=False,
        )
        engine = Engine.load(cfg)
        if ns.graphs:
            from tests.engine.eager_graphs import install_eager_graphs

            install_eager_graphs(engine)
        timers = Timers(engine)
        print(where())
        print(
            f"tiny random Llama (1 layer, hidden 32, vocab {len(engine.tokenizer)}, SmolLM2's tokenizer), "
            f"1 thread, {'seeded sampling' if ns.sample else 'greedy'}, {PROMPT_LEN}-token prompts"
            f"{', the CUDA-graph path (replays eager)' if ns.graphs else ''}; {ns.steps} timed decode steps, "
            f"best of {ns.repeats}"
        )

        def host(r: dict[str, float]) -> float:
            return r["total"] - sum(r[k] for k in PARTS)

        per_n: dict[int, dict[str, float]] = {}
        for n in SIZES:
            runs = [run(engine, timers, n, ns.steps, ns.warmup, ns.sample) for _ in range(ns.repeats)]
            per_n[n] = min(runs, key=host)
        cols = ("total", "host", *PARTS)
        print(f"{'N':>6} " + " ".join(f"{c + ' ms/step':>17}" for c in cols) + f" {'host us/seq/step':>17}")
        for n, r in per_n.items():
            vals = {"host": host(r), **r}
            line = " ".join(f"{vals[c] / ns.steps * 1e3:>17.2f}" for c in cols)
            ended = (
                ""
                if r["seq_steps"] == n * ns.steps
                else f"  ({n * ns.steps - r['seq_steps']:.0f} seq-steps ended)"
            )
            print(f"{n:>6} {line} {host(r) / r['seq_steps'] * 1e6:>17.2f}{ended}")
        lo, hi = per_n[SIZES[0]], per_n[SIZES[-1]]
        for label, f in (("host", host), ("total", lambda r: r["total"])):
            # the line through (seq_steps, seconds) at the smallest and largest N
            slope = (f(hi) - f(lo)) / (hi["seq_steps"] - lo["seq_steps"])  # s per sequence per step
            fixed = (f(lo) - slope * lo["seq_steps"]) / ns.steps  # s per step
            print(
                f"{label:>5}: {slope * 1e6:6.2f} us per sequence per step (marginal, {SIZES[0]}..{SIZES[-1]}), "
                f"{fixed * 1e3:6.2f} ms fixed per step (intercept)"
            )
        if ns.profile:
            prof = cProfile.Profile()
            run(engine, timers, 256, ns.steps, ns.warmup, ns.sample, prof)
            print_profile(prof, ns.steps, 256)
        if ns.device_ms > 0:
            print()
            overlap_table(cfg, ns)
    return 0


def overlap_table(cfg: Any, ns: argparse.Namespace) -> int:
    """--device-ms: ms per decode step, serial and overlapped, on the stand-in device."""
    from worker.engine.engine import Engine

    engines = {}
    for overlapped in (False, True):
        engines[overlapped] = engine = Engine.load(cfg.model_copy(update={"async_scheduling": overlapped}))
        stand_in_device(engine, ns.device_ms)
    d = ns.device_ms
    print(
        f"stand-in device: {d:g} ms per step (sleeping, the GIL free), logits over {STAND_IN_VOCAB} ids; "
        f"{'seeded sampling' if ns.sample else 'greedy'}; {ns.steps} timed decode steps, best of {ns.repeats}"
    )
    print(f"{'N':>6} {'serial ms/step':>15} {'overlapped ms/step':>19} {'overlapped / D':>15}")
    for n in SIZES:
        best: dict[bool, float] = {}
        tokens: list[list[list[int]]] = []
        for overlapped, engine in engines.items():
            runs = [overlap(engine, n, ns.steps, ns.warmup, ns.sample) for _ in range(ns.repeats)]
            best[overlapped] = min(ms for ms, _ in runs)
            tokens += [t for _, t in runs]
        assert all(t == tokens[0] for t in tokens), f"N={n}: the runs' tokens differ (serial and overlapped)"
        print(f"{n:>6} {best[False]:>15.2f} {best[True]:>19.2f} {best[True] / d:>15.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
