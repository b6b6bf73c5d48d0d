"""Embedding requests through the engine against Hugging Face's batched forward, same model, same run.

    .venv/bin/python benchmarks/embed_bench.py [--model smollm2-135m] [--texts 32] [--batch 16]
        [--pooling last|mean]

The peer is what a sentence-transformers user runs: padded batches of `--batch` texts through the bare
decoder (right padding, the attention mask), pooled at each text's last token or by the mean over its
tokens, L2-normalised. The engine gets every text as one input of a few embedding requests and packs them
without padding. Prints input tokens/s of each, the ratio, and the largest difference between the two
vectors of a text (float32 on the CPU: both compute the same function).
"""

from __future__ import annotations

import argparse
import platform
import random
import time

import torch

from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EmbeddingInputs, EngineRequest
from worker.engine_config import EngineConfig

WORDS = [
    "the",
    "a",
    "batch",
    "of",
    "labels",
    "model",
    "queue",
    "worker",
    "token",
    "embedding",
    "vector",
    "review",
    "order",
    "ship",
    "late",
    "refund",
]


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120))) for _ in range(n)]


@torch.inference_mode()
def hf_embed(hf, tok, items: list[str], batch: int, pooling: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = []
    for i in range(0, len(items), batch):
        enc = tok(items[i : i + batch], padding=True, return_tensors="pt")
        hidden = hf.model(**enc).last_hidden_state.float()  # [B, L, hidden]
        mask = enc.attention_mask.unsqueeze(-1).float()
        if pooling == "mean":
            vec = (hidden * mask).sum(1) / mask.sum(1)
        else:
            vec = hidden[torch.arange(hidden.shape[0]), enc.attention_mask.sum(1) - 1]
        out.append(torch.nn.functional.normalize(vec, dim=-1))
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--texts", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--pooling", choices=["last", "mean"], default="last")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.models.resolve import hf_checkpoint

    engine = Engine.load(EngineConfig(model=args.model, dtype="float32", embedding_pooling=args.pooling))
    ckpt = hf_checkpoint(args.model)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    tok.padding_side = "right"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    items = texts(args.texts)
    n_tokens = sum(len(tok(t).input_ids) for t in items)
    hf_embed(hf, tok, items[:2], args.batch, args.pooling)  # warm-up
    engine.generate(
        [EngineRequest("warm", GenerationParams(max_new_tokens=1), embedding=EmbeddingInputs(items[:2]))]
    )

    t0 = time.perf_counter()
    want = hf_embed(hf, tok, items, args.batch, args.pooling)
    hf_s = time.perf_counter() - t0
    per = 8  # inputs per embedding request
    reqs = [
        EngineRequest(
            f"e{i}", GenerationParams(max_new_tokens=1), embedding=EmbeddingInputs(items[i : i + per])
        )
        for i in range(0, len(items), per)
    ]
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    engine_s = time.perf_counter() - t0
    got = torch.tensor([v for r in results for v in (r.embeddings or [])])
    diff = (got - want).abs().max().item()

    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(f"{args.model}, {args.texts} texts, {n_tokens} tokens, pooling {args.pooling}, float32")
    print("| path | seconds | input tok/s |")
    print("|---|---:|---:|")
    print(f"| HF forward, padded batches of {args.batch} | {hf_s:.2f} | {n_tokens / hf_s:,.0f} |")
    print(
        f"| batchq engine, {len(reqs)} requests x {per} inputs | {engine_s:.2f} | {n_tokens / engine_s:,.0f} |"
    )
    print(f"ratio engine / HF: {hf_s / engine_s:.2f}x; largest |difference| of a vector element: {diff:.1e}")


if __name__ == "__main__":
    main()
