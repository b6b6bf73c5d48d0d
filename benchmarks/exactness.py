"""How far each dtype's numbers sit from Hugging Face's float32 on the real model, and whether they hold
batch invariance: the figures README's "What exact means" table quotes.

    python benchmarks/exactness.py                  # float32 and bfloat16, batch-invariant (the default)
    python benchmarks/exactness.py --dtype bfloat16 --no-batch-invariant   # torch's bf16 ops (slow on AVX2)

For each engine: the label log-probabilities of `choices` lines (every label, teacher-forced, then EOS)
and the greedy tokens' log-probabilities of free-text lines, against HF float32 `forward` on the same
token ids; then the same lines answered alone and inside one mixed batch, compared bit for bit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.engine.engine import Engine  # noqa: E402
from worker.engine.params import GenerationParams  # noqa: E402
from worker.engine.request import EngineRequest  # noqa: E402
from worker.engine_config import EngineConfig  # noqa: E402

REVIEWS = [
    "The zipper broke on day one.",
    "Arrived early, fits perfectly, and the colour is exactly as shown.",
    "It's fine. Does what it says, nothing more.",
    "Support never answered my three emails, but the blender itself is great.",
    "Worst purchase this year: the seams split after a single wash.",
    "Five stars. My kids love it and it survived the dog.",
    "The manual is in Dutch only; the product works once you figure it out.",
    "Refund took two months and three phone calls.",
]
LABELS = ("positive", "negative", "neutral", "mixed")


def chat(review: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Is this review positive, negative, neutral or mixed? '{review}'"}]


def requests() -> list[EngineRequest]:
    label = GenerationParams(max_new_tokens=1, temperature=0.0, choices=LABELS)
    free = GenerationParams(max_new_tokens=16, temperature=0.0, logprobs=True)
    return [
        *(EngineRequest(f"label{i}", label, messages=chat(r)) for i, r in enumerate(REVIEWS)),
        *(EngineRequest(f"free{i}", free, messages=chat(r)) for i, r in enumerate(REVIEWS)),
    ]


@torch.no_grad()
def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def measure(engine: Engine, hf) -> dict[str, object]:  # type: ignore[no-untyped-def]
    reqs = requests()
    mixed = engine.generate(reqs)
    alone = [engine.generate([r])[0] for r in reqs]
    eos = engine.eos_token_ids[0]
    label_err = token_err = 0.0
    for req, res in zip(reqs, mixed, strict=True):
        prompt = engine.prompts.tokenize(req)
        if res.label_scores:
            for score, ids in zip(res.label_scores, engine.prompts.label_ids(LABELS), strict=True):
                lp = hf_logprobs(hf, prompt + ids)
                want = sum(float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate([*ids, eos]))
                label_err = max(label_err, abs(score.logprob - want))
        else:
            lp = hf_logprobs(hf, prompt + res.token_ids)
            for i, entry in enumerate(res.logprobs or []):
                token_err = max(
                    token_err, abs(entry.logprob - float(lp[len(prompt) - 1 + i, res.token_ids[i]]))
                )
    same = sum(
        (a.text, a.token_ids, a.label_scores, a.logprobs) == (b.text, b.token_ids, b.label_scores, b.logprobs)
        for a, b in zip(alone, mixed, strict=True)
    )
    return {"label": label_err, "token": token_err, "same": f"{same}/{len(reqs)}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", action="append", choices=["float32", "bfloat16"], help="default: both")
    p.add_argument("--no-batch-invariant", dest="invariant", action="store_false")
    ns = p.parse_args()
    from transformers import AutoModelForCausalLM

    from worker.models.resolve import hf_checkpoint

    hf = AutoModelForCausalLM.from_pretrained(hf_checkpoint("smollm2-135m"), dtype=torch.float32).eval()
    rows = []
    for dtype in ns.dtype or ["float32", "bfloat16"]:
        cfg = EngineConfig(model="smollm2-135m", dtype=dtype, batch_invariant=ns.invariant, kv_cache_gb=0.3)
        engine = Engine.load(cfg)
        rows.append((dtype, engine.batch_invariant, measure(engine, hf)))
        del engine
    print(
        f"smollm2-135m, {len(REVIEWS)} choices lines and {len(REVIEWS)} greedy lines of 16 tokens; HF float32"
    )
    print("| dtype | batch-invariant | max abs label logprob vs HF | max abs token logprob vs HF | "
          "alone == in the mixed batch |")  # fmt: skip
    print("|---|---|---:|---:|---:|")
    for dtype, invariant, m in rows:
        print(
            f"| {dtype} | {'yes' if invariant else 'no'} | {m['label']:.2e} | {m['token']:.2e} | {m['same']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
