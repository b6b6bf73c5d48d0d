"""What serving many LoRA adapters in one batch costs: 8 adapters x 32 requests mixed in one batch, against
the same requests run adapter by adapter (one adapter's 32 at a time, as a worker per adapter would), and
against the base model alone on the same prompts (the cost of LoRA itself). The engine directly, one
process, SmolLM2-135M; the adapters are rank 16 on every attention and MLP projection, random, written in
PEFT's layout (adapter_config.json + adapter_model.safetensors).

    python benchmarks/lora_bench.py                       # CPU, float32, 32 new tokens per request
    python benchmarks/lora_bench.py --device cuda --dtype bfloat16

Each row is timed after an untimed warm-up run of the same engine. Memory: the adapters' weights as the
engine holds them (host), and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.engine.engine import Engine  # noqa: E402
from worker.engine.params import GenerationParams  # noqa: E402
from worker.engine.request import EngineRequest  # noqa: E402
from worker.engine_config import EngineConfig  # noqa: E402

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, c: Any, rank: int, seed: int) -> Path:
    """A random rank-`rank` LoRA on every projection of a decoder of config `c`'s shapes, in PEFT's layout."""
    from safetensors.torch import save_file

    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    h, inter = c.hidden_size, c.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_hidden_layers):
        for m, (n_in, n_out) in shapes.items():
            part = "self_attn" if m in MODULES[:4] else "mlp"
            pre = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.02
            tensors[f"{pre}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(MODULES),
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def requests(adapters: Sequence[str | None], per: int, max_new: int) -> list[EngineRequest]:
    """`per` requests for each of `adapters` (None: the base model), the same prompts for each."""
    params = GenerationParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    return [
        EngineRequest(
            f"{k}-{a}-{i}",
            params,
            lora=a,
            prompt=f"Review {i}: the product arrived on time and works well. Label:",
        )
        for k, a in enumerate(adapters)
        for i in range(per)
    ]


def timed(engine: Engine, groups: list[list[EngineRequest]]) -> tuple[int, float]:
    t0 = time.monotonic()
    tokens = sum(len(r.token_ids) for g in groups for r in engine.generate(g))
    return tokens, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--per-adapter", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    names = [f"a{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        from transformers import AutoConfig

        from worker.models.resolve import resolve_checkpoint

        hf = AutoConfig.from_pretrained(resolve_checkpoint(args.model))
        paths = {n: str(write_adapter(Path(tmp) / n, hf, args.rank, i)) for i, n in enumerate(names)}
        cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, lora=paths,
                           max_loras=args.adapters)  # fmt: skip
        engine = Engine.load(cfg)
        assert engine.loras is not None
        mixed = requests(names, args.per_adapter, args.max_new_tokens)
        one_by_one = [requests([n], args.per_adapter, args.max_new_tokens) for n in names]
        base = requests([None] * args.adapters, args.per_adapter, args.max_new_tokens)
        rows = [
            ("base model alone", [base]),
            (f"{args.adapters} adapters mixed in one batch", [mixed]),
            ("adapter by adapter", one_by_one),
        ]
        engine.generate(requests([*names[:2], None], 4, 4))  # untimed: the first steps pay one-off costs
        print(f"# {platform.processor() or platform.machine()}, {args.model} {args.dtype} {args.device}, "
              f"{args.adapters} adapters x {args.per_adapter} requests, rank {args.rank}, {args.max_new_tokens} "
              f"new tokens each; command: python benchmarks/lora_bench.py {' '.join(sys.argv[1:])}")  # fmt: skip
        print("| run | requests | tokens | seconds | tok/s | vs base |")
        print("|---|---:|---:|---:|---:|---:|")
        base_rate = None
        for label, groups in rows:
            tokens, seconds = timed(engine, groups)
            rate = tokens / seconds
            base_rate = base_rate or rate
            n = sum(len(g) for g in groups)
            print(
                f"| {label} | {n} | {tokens} | {seconds:.2f} | {rate:,.0f} | {rate / base_rate:.2f}x |",
                flush=True,
            )
        held = sum(a.bytes for a in engine.loras.adapters.values())
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"\nadapters' weights held: {held / 2**20:.1f} MiB ({args.adapters} x rank {args.rank}); "
            f"peak RSS {rss:,.0f} MiB"
        )


if __name__ == "__main__":
    main()
