"""A small random mixture-of-experts model (Qwen3-MoE: hidden 256, 8 experts top-2, 4 layers): the engine's
greedy decoding against HF transformers `generate` on the same prompts, tok/s of each and their agreement;
`make bench` reports it as its MoE row (bench.py runs this in a process of its own, --json).

    .venv/bin/python benchmarks/moe_model_bench.py [--prompts 16 --new 32 --dtype float32]

Both run in this process, one after the other, on the same checkpoint (random weights, built in a temporary
folder through the production loader), the same prompts of equal length (HF's batch needs no padding),
max_new_tokens and greedy decoding, EOS ignored: HF as one batch of every prompt, the engine with every
request submitted at once. Times are wall time of the whole generation, best of --passes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = {
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256, "num_experts": 8,
    "num_experts_per_tok": 2, "norm_topk_prob": True, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 512,
}  # fmt: skip


def run(prompts: int, new: int, dtype: str, passes: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import build_tiny_checkpoint
    from worker.engine.engine import Engine
    from worker.engine.params import GenerationParams
    from worker.engine.request import EngineRequest
    from worker.engine_config import EngineConfig

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 259, (prompts, 64), generator=gen)
    with tempfile.TemporaryDirectory() as d:
        path = build_tiny_checkpoint(Path(d), "qwen3_moe", **CONFIG)
        engine = Engine.load(EngineConfig(model=str(path), dtype=dtype, kv_cache_gb=0.25))  # type: ignore[arg-type]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    params = GenerationParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    best_engine, ours = float("inf"), []
    for p in range(passes):
        reqs = [
            EngineRequest(f"p{p}r{i}", params, prompt_token_ids=row.tolist()) for i, row in enumerate(ids)
        ]
        t = time.perf_counter()
        ours = [r.token_ids for r in engine.generate(reqs)]
        best_engine = min(best_engine, time.perf_counter() - t)
    best_hf, theirs = float("inf"), []
    with torch.no_grad():
        for _ in range(passes):
            t = time.perf_counter()
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              eos_token_id=[], pad_token_id=0)  # fmt: skip
            best_hf = min(best_hf, time.perf_counter() - t)
            theirs = out[:, ids.shape[1] :].tolist()
    tokens = prompts * new
    return {
        "model": "random Qwen3-MoE, hidden 256, 8 experts top-2, 4 layers",
        "dtype": dtype,
        "prompts": prompts,
        "new_tokens": new,
        "engine_tokens_per_s": tokens / best_engine,
        "hf_tokens_per_s": tokens / best_hf,
        "engine_vs_hf": best_hf / best_engine,
        "greedy_equal_to_hf": f"{sum(a == b for a, b in zip(ours, theirs, strict=True))}/{prompts}",
        "experts_summary": engine.model_runner.backend.moe.name,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--json", help="also write the result to this file")
    ns = p.parse_args()
    res = run(ns.prompts, ns.new, ns.dtype, ns.passes)
    print(f"command: {' '.join(sys.argv)}")
    print(f"{res['model']}, {res['dtype']}, {res['prompts']} prompts x {res['new_tokens']} new tokens")
    print(f"{'':>8} | {'tok/s':>8}")
    print(
        f"{'engine':>8} | {res['engine_tokens_per_s']:>8.1f}   ({res['engine_vs_hf']:.2f}x HF; experts on {res['experts_summary']})"
    )
    print(f"{'HF':>8} | {res['hf_tokens_per_s']:>8.1f}")
    print(f"greedy tokens equal to HF: {res['greedy_equal_to_hf']}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
