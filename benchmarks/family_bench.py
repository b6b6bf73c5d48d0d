"""One non-Llama family on the CPU: a small random Gemma 2 (interleaved local / global layers, soft-caps,
(1 + w) norms around each sublayer, GELU-tanh) through the engine and through HF `generate`, the same
prompts, greedy, EOS ignored (a random model's EOS would end sequences at random).

    python benchmarks/family_bench.py [-n 16] [--new 32] [--out OUT.json]

bench.py runs it in its own process (a row of its own: the SmolLM2 rows' HF baseline is another model).
The checkpoint is built like tests/tiny_models' (random norms and biases) in a temp dir and loaded through
the production loader; HF runs the same folder with one left-padded batch of every prompt, the batch size
its sweep in bench.py finds best for small models. Runtime: well under a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# 4 layers of hidden 384: ~9M parameters (a byte vocabulary), big enough that the linears dominate a step
SHAPE: dict[str, Any] = {
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "query_pre_attn_scalar": 64,
    "sliding_window": 64,  # shorter than most prompts: the local layers attend within it
    "max_position_embeddings": 1024,
    "initializer_range": 0.05,
}
NAME = "random Gemma 2 (4 layers, hidden 384)"


def prompts(n: int, seed: int) -> list[list[int]]:
    """n prompts of 48-240 byte tokens (ids 3..258, the byte tokenizer's)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randrange(48, 241))] for _ in range(n)]


def run_engine(path: Path, batch: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    from worker.engine.engine import Engine
    from worker.engine.params import GenerationParams
    from worker.engine.request import EngineRequest
    from worker.engine_config import EngineConfig

    engine = Engine.load(EngineConfig(dtype="float32", model=str(path), kv_cache_gb=0.5))
    params = GenerationParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    warm = GenerationParams(temperature=0, max_new_tokens=2, ignore_eos=True)  # first-call costs, untimed
    engine.generate([EngineRequest(f"warm{i}", warm, prompt_token_ids=p) for i, p in enumerate(batch[:4])])
    t0 = time.perf_counter()
    results = engine.generate(
        [EngineRequest(f"r{i}", params, prompt_token_ids=p) for i, p in enumerate(batch)]
    )
    return time.perf_counter() - t0, [r.token_ids for r in results]


def run_hf(path: Path, batch: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    kw = {"max_new_tokens": new, "do_sample": False, "pad_token_id": 0, "eos_token_id": []}  # EOS ignored
    with torch.no_grad():
        model.generate(ids[:4], attention_mask=mask[:4], **{**kw, "max_new_tokens": 2})  # untimed
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
    return time.perf_counter() - t0, out[:, width:].tolist()


def measure(n: int, new: int, seed: int) -> dict[str, Any]:
    from tests.tiny_models import build_tiny_checkpoint

    batch = prompts(n, seed)
    with tempfile.TemporaryDirectory() as d:
        path = build_tiny_checkpoint(Path(d) / "gemma2", "gemma2", seed=seed, **SHAPE)
        engine_s, ours = run_engine(path, batch, new)
        hf_s, theirs = run_hf(path, batch, new)
    tokens = n * new
    return {
        "name": NAME,
        "requests": n,
        "output_tokens": tokens,
        "engine_tokens_per_s": tokens / engine_s,
        "hf_tokens_per_s": tokens / hf_s,
        "vs_hf": hf_s / engine_s,
        "greedy_equal_to_hf": sum(a == b for a, b in zip(ours, theirs, strict=True)),
    }


def table(row: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"| family on the CPU, float32 ({row['requests']} prompts of 48-240 tokens, "
            f"{row['output_tokens'] // row['requests']} new each) | engine tok/s | HF generate tok/s | vs HF "
            "| greedy equal |",
            "|---|---:|---:|---:|---:|",
            f"| {row['name']} | {row['engine_tokens_per_s']:.1f} | {row['hf_tokens_per_s']:.1f} | "
            f"{row['vs_hf']:.2f}x | {row['greedy_equal_to_hf']}/{row['requests']} |",
        ]
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=16, help="prompts")
    p.add_argument("--new", type=int, default=32, help="new tokens per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the row as JSON here")
    ns = p.parse_args()
    row = measure(ns.n, ns.new, ns.seed)
    print(table(row))
    if ns.out:
        Path(ns.out).write_bytes(orjson.dumps(row, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
