"""Loading a checkpoint: batchq's loader against reading its files once, and against the former path
(Hugging Face's from_pretrained, then a copy into our decoder), in one run.

    .venv/bin/python benchmarks/load_bench.py [--gb 4.5] [--shards 5] [--cache-dir DIR] [--clean]
        [--serve bfloat16,float32] [--former bfloat16] [--device cpu] [--tp N]

Builds, or reuses from --cache-dir, a synthetic Llama checkpoint of about --gb GB: bfloat16 safetensors in
--shards shards with an index, random weights written tensor by tensor by this script (no Hugging Face
model is built), Llama 3's vocabulary and a byte tokenizer. Each measurement runs in a fresh child process
and starts cold-ish: every file of the checkpoint is fsync'ed at build and dropped from the page cache with
posix_fadvise(POSIX_FADV_DONTNEED) before the child starts (the disk's own cache stays warm). The children:

- read: the files once, front to back, through one 16 MiB buffer (the time any loader must spend);
- batchq: worker.models.loader.load_model into each --serve dtype on --device (with --tp N, rank 0's
  share of a tensor-parallel group of N: "largest tensor" is then its slice);
- former: the former native path in --former dtypes: from_pretrained in the serving dtype, our decoder
  built empty beside it and filled from Hugging Face's state dict, then Hugging Face's model dropped.

Memory: the child resets its peak RSS (/proc/self/clear_refs 5) after its imports, so VmHWM is the peak of
the load alone; "above weights" is that peak minus the RSS before the load minus the final weights' bytes
(on a GPU the weights are not host memory: it is then the peak above the RSS before the load). The
anon/file split of the peak comes from /proc/self/status sampled every 5 ms during the load (RssAnon,
RssFile), so it can miss a peak shorter than that. batchq's and the former path's weights are compared by
a SHA-256 over every parameter's bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VOCAB, HIDDEN, INTER, HEADS, KV_HEADS = 128256, 3072, 8192, 24, 8  # a Llama-3.2-3B-wide layer
READ_BUFFER = 16 << 20


# ---- the synthetic checkpoint ------------------------------------------------------------------------


def layer_count(gb: float) -> int:
    """Layers for a bfloat16 checkpoint of about `gb` GB beside the two vocabulary tables."""
    head_dim = HIDDEN // HEADS
    per_layer = HIDDEN * (HEADS + 2 * KV_HEADS) * head_dim + HEADS * head_dim * HIDDEN + 3 * HIDDEN * INTER
    return max(1, round((gb * 1e9 / 2 - 2 * VOCAB * HIDDEN) / per_layer))


def shapes(layers: int) -> dict[str, tuple[int, ...]]:
    head_dim = HIDDEN // HEADS
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN),
            p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER),
        }
    return out | {"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_shard(path: Path, tensors: dict[str, tuple[int, ...]], seed: int) -> None:
    """A bfloat16 safetensors file written tensor by tensor: the header, then each tensor's random values
    generated and written in chunks of rows (the writer holds one chunk, not the shard)."""
    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + 2 * numel(shape)],
        }
        offset += 2 * numel(shape)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    gen = torch.Generator().manual_seed(seed)
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for shape in tensors.values():
            rows = shape[0]
            step = max(1, (32 << 20) // (4 * numel(shape[1:])))
            for start in range(0, rows, step):
                chunk = torch.randn((min(step, rows - start), *shape[1:]), generator=gen) * 0.02
                f.write(chunk.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


def build_checkpoint(folder: Path, layers: int, shards: int) -> None:
    """The checkpoint in `folder` (reused when its marker says it is complete)."""
    if (folder / "complete").exists():
        return
    from transformers import LlamaConfig

    from tests.tiny_models import byte_tokenizer

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    all_shapes = shapes(layers)
    total = sum(2 * numel(s) for s in all_shapes.values())
    groups: list[dict[str, tuple[int, ...]]] = [{}]
    size = 0
    for name, shape in all_shapes.items():  # shards of about total / shards bytes, in model order
        if groups[-1] and size + numel(shape) > total * len(groups) / shards and len(groups) < shards:
            groups.append({})
        groups[-1][name] = shape
        size += 2 * numel(shape)
    weight_map = {}
    t0 = time.monotonic()
    for k, group in enumerate(groups):
        shard = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        write_shard(folder / shard, group, seed=k)
        weight_map |= dict.fromkeys(group, shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, dtype="bfloat16",
    ).save_pretrained(folder)  # fmt: skip
    byte_tokenizer().save_pretrained(folder)
    (folder / "complete").write_text(f"built in {time.monotonic() - t0:.0f}s\n")


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def drop_from_page_cache(folder: Path) -> None:
    for path in weight_files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---- the children --------------------------------------------------------------------------------------


def status() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile of this process, in bytes."""
    text = Path("/proc/self/status").read_text()
    return {
        k: int(v) * 1024 for k, v in re.findall(r"^(VmHWM|VmRSS|RssAnon|RssFile):\s+(\d+) kB", text, re.M)
    }


class Sampler:
    """The largest RssAnon and RssFile seen while it runs, every 5 ms."""

    def __init__(self) -> None:
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            s = status()
            for k in self.peak:
                self.peak[k] = max(self.peak[k], s[k])

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        s = status()
        for k in self.peak:
            self.peak[k] = max(self.peak[k], s[k])


def child_read(folder: Path) -> dict[str, Any]:
    buf = memoryview(bytearray(READ_BUFFER))
    total = 0
    t0 = time.perf_counter()
    for path in weight_files(folder):
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return {"seconds": time.perf_counter() - t0, "bytes": total}


def former_load(folder: Path, dtype: Any, device: Any) -> Any:
    """The former native path: Hugging Face's model in the serving dtype, our decoder filled from it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from worker.models.llama import LlamaFamilyModel
    from worker.models.loader import _rotary, _spec, context_length

    cfg = AutoConfig.from_pretrained(folder)
    AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    sd = hf.state_dict()
    ours = LlamaFamilyModel.empty(
        _spec(cfg, set(sd)), _rotary(str(folder), cfg, context_length(cfg), device), dtype, device
    )
    ours.load_weights(sd.items())
    del hf, sd
    return ours


def child_load(folder: Path, path: str, dtype_name: str, device_name: str, tp: str = "1") -> dict[str, Any]:
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: F401

    from worker.models.loader import load_model

    # transformers' modules are imported before the clock starts and the peak is reset, as a worker has
    # them by the time it loads: the load is what is measured, not Python's imports.
    from worker.parallel.group import TPGroup

    dtype, device = getattr(torch, dtype_name), torch.device(device_name)
    # rank 0's share of a tensor-parallel group: loading runs no collective, so no group is joined
    group = TPGroup(0, int(tp), None, None, None) if int(tp) > 1 else None
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here: the load's peak alone
    before = status()
    t0 = time.perf_counter()
    with Sampler() as sampler:
        if path == "batchq":
            model: Any = load_model(str(folder), dtype, device, tp=group).model
        else:
            model = former_load(folder, dtype, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    after = status()
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().data)
    return {"seconds": seconds, "before": before, "after": after, "peak": sampler.peak, "weights": weights,
            "host_weights": weights if device.type == "cpu" else 0, "digest": digest.hexdigest()[:16]}  # fmt: skip


def run_child(args: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", *args]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.splitlines()[-1]))


# ---- the table ------------------------------------------------------------------------------------


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def spread(r: dict[str, Any]) -> str:
    return " ".join(f"{t:.2f}" for t in r["all_seconds"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=4.5, help="checkpoint size in GB (bfloat16)")
    ap.add_argument("--shards", type=int, default=5)
    ap.add_argument("--cache-dir", type=Path, default=None, help="default: $BATCHQ_CACHE_DIR/load-bench")
    ap.add_argument("--clean", action="store_true", help="delete the checkpoint after the run")
    ap.add_argument("--serve", default="bfloat16,float32", help="dtypes batchq's loader loads into")
    ap.add_argument("--former", default="bfloat16", help="dtypes the former path loads into ('' for none)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tp", type=int, default=1, help="batchq loads rank 0's share of a group this size")
    ap.add_argument(
        "--repeat", type=int, default=3, help="runs of each measurement (median time, highest peak)"
    )
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, folder = args.child[0], Path(args.child[1])
        result = child_read(folder) if kind == "read" else child_load(folder, kind, *args.child[2:])
        print(json.dumps(result))
        return

    from worker.cache_dir import cache_dir

    layers = layer_count(args.gb)
    base = args.cache_dir or cache_dir() / "load-bench"
    folder = base / f"llama-h{HIDDEN}-l{layers}-v{VOCAB}-bf16-{args.shards}shards"
    t0 = time.monotonic()
    build_checkpoint(folder, layers, args.shards)
    built = f"built in {time.monotonic() - t0:.0f}s" if time.monotonic() - t0 > 1 else "reused"
    all_shapes = shapes(layers)
    files = weight_files(folder)
    file_bytes = sum(p.stat().st_size for p in files)
    largest = max(all_shapes.items(), key=lambda kv: numel(kv[1]))

    def cold(child: list[str]) -> dict[str, Any]:
        drop_from_page_cache(folder)
        return run_child(child)

    def repeated(child: list[str]) -> dict[str, Any]:
        """The median run by time (the machine's load varies), with every run's time and the highest peak."""
        rs = sorted((cold(child) for _ in range(args.repeat)), key=lambda r: float(r["seconds"]))
        median = dict(rs[len(rs) // 2])
        median["all_seconds"] = [r["seconds"] for r in rs]
        if "after" in median:
            median["after"] = dict(median["after"], VmHWM=max(r["after"]["VmHWM"] for r in rs))
        return median

    read = repeated(["read", str(folder)])
    runs = [("batchq", d) for d in args.serve.split(",") if d]
    runs += [("former", d) for d in args.former.split(",") if d]
    results = [(path, dtype, repeated([path, str(folder), dtype, args.device, str(args.tp if path == "batchq" else 1)]))
               for path, dtype in runs]  # fmt: skip

    print(f"# load_bench: {platform.node()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, "
          f"device {args.device}")  # fmt: skip
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(
        f"checkpoint: {folder} ({built}): Llama, {layers} layers, "
        f"hidden {HIDDEN}, vocab {VOCAB}, bfloat16, {len(files)} shards, {gb(file_bytes)} GB; largest tensor "
        f"{largest[0]} {list(largest[1])}, {gb(2 * numel(largest[1]))} GB (bfloat16)"
    )
    print(f"read once (one thread, 16 MiB reads; cold-ish: posix_fadvise DONTNEED first): {read['seconds']:.2f} s "
          f"median of {spread(read)}, {read['bytes'] / read['seconds'] / 1e9:.2f} GB/s")  # fmt: skip
    print(f"each row: median load time of {args.repeat} runs (all in the last column), highest peak\n")
    print("| path | serve dtype | final weights GB | peak RSS (VmHWM) GB | RSS before GB | peak anon / file GB "
          "| peak above weights GB | largest tensor GB (served) | above / largest | load s | load / read once "
          "| weights digest | runs s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path, dtype, r in results:
        item = 4 if dtype == "float32" else 2
        split = args.tp if path == "batchq" else 1
        largest_served = item * numel(largest[1]) // split  # a rank's slice of it
        above = r["after"]["VmHWM"] - r["before"]["VmRSS"] - r["host_weights"]
        name = "batchq (streamed)" if path == "batchq" else "former (HF from_pretrained + copy)"
        if split > 1:
            name = f"batchq (streamed), rank 0 of {split}"
        print(
            f"| {name} | {dtype} | {gb(r['weights'])} | {gb(r['after']['VmHWM'])} | {gb(r['before']['VmRSS'])} "
            f"| {gb(r['peak']['RssAnon'])} / {gb(r['peak']['RssFile'])} | {gb(above)} | {gb(largest_served)} "
            f"| {above / largest_served:.2f} | {r['seconds']:.2f} | {r['seconds'] / read['seconds']:.2f} "
            f"| {r['digest']} | {spread(r)} |"
        )
    if args.clean:
        shutil.rmtree(folder)
        print(f"\nremoved {folder}")


if __name__ == "__main__":
    main()
