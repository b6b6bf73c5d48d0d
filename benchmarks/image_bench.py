"""Images through the engine against Hugging Face's generate, on the same tiny random Qwen2-VL
(tests/tiny_vision.py) and the same images: images/s and output tok/s, and where the engine's time goes
(decoding and processing images on CPU threads, the vision tower, the rest: the decoder's steps).

    python benchmarks/image_bench.py                     # 64 requests of 1-2 images, 32 new tokens each
    python benchmarks/image_bench.py --requests 128 --device cuda

HF runs each request alone (its Qwen2-VL generate pads a batch's images and prompts; one at a time is
how its examples run it), greedy with EOS ignored (ignore_eos; HF's eos_token_id=[]), float32 on the CPU;
the engine takes them all at once. Both outputs are compared token for token.
"""

from __future__ import annotations

import argparse
import io
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.tiny_vision import IMAGE_PAD, build_tiny_qwen2_vl, hf_vl, png  # noqa: E402
from worker.engine.engine import Engine  # noqa: E402
from worker.engine.params import GenerationParams  # noqa: E402
from worker.engine.request import EngineRequest  # noqa: E402
from worker.engine_config import EngineConfig  # noqa: E402


def workload(n: int) -> list[tuple[list[dict[str, Any]], list[bytes]]]:
    out = []
    for i in range(n):
        k = 1 + i % 2
        images = [
            png(56 + 14 * ((i + j) % 5), 56 + 14 * ((i * 3 + j) % 4), 1000 + i * 7 + j) for j in range(k)
        ]
        parts: list[dict[str, Any]] = [{"type": "image"} for _ in images]
        out.append(
            ([{"role": "user", "content": [*parts, {"type": "text", "text": f"Label photo {i}."}]}], images)
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    from PIL import Image

    with tempfile.TemporaryDirectory(prefix="image-bench-") as tmp:
        path = build_tiny_qwen2_vl(Path(tmp) / "qwen2-vl", seed=3)
        engine = Engine.load(EngineConfig(model=str(path), device=args.device, dtype="float32"))
        assert engine.images is not None
        jobs = workload(args.requests)
        n_images = sum(len(imgs) for _, imgs in jobs)
        params = GenerationParams(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
        engine.generate([EngineRequest("warm", params, messages=jobs[0][0], images=jobs[0][1])])
        images = engine.images
        images.prepare_s = images.encode_s = 0.0
        t0 = time.perf_counter()
        ours = engine.generate([EngineRequest(f"r{i}", params, messages=m, images=imgs)
                                for i, (m, imgs) in enumerate(jobs)])  # fmt: skip
        engine_s = time.perf_counter() - t0
        prep_s, enc_s = images.prepare_s, images.encode_s
        hf = hf_vl(path).to(args.device)
        tok, proc = engine.tokenizer, images.tower.processor
        hf_prep = 0.0
        t0 = time.perf_counter()
        theirs = []
        for messages, imgs in jobs:
            t1 = time.perf_counter()
            ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False).input_ids  # fmt: skip
            out = proc(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in imgs], return_tensors="pt")
            grids, expanded, it = out["image_grid_thw"], [], iter(out["image_grid_thw"])
            for t in ids:
                expanded += [IMAGE_PAD] * int(next(it).prod() // 4) if t == IMAGE_PAD else [t]
            hf_prep += time.perf_counter() - t1
            input_ids = torch.tensor([expanded], device=args.device)
            with torch.no_grad():
                gen = hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                  pixel_values=out["pixel_values"].to(args.device), image_grid_thw=grids.to(args.device),
                                  mm_token_type_ids=(input_ids == IMAGE_PAD).int(), max_new_tokens=args.max_new_tokens,
                                  eos_token_id=[], do_sample=False)  # fmt: skip
            theirs.append(gen[0, len(expanded) :].tolist())
        hf_s = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in ours)
    same = sum(r.token_ids == t for r, t in zip(ours, theirs, strict=True))
    print(f"# {platform.processor() or platform.machine()}, tiny random Qwen2-VL float32 {args.device}, "
          f"{args.requests} requests ({n_images} images of 56-112 px), {args.max_new_tokens} new tokens each; "
          f"command: python benchmarks/image_bench.py {' '.join(sys.argv[1:])}")  # fmt: skip
    print("| contender | seconds | images/s | output tok/s | preprocessing | vision tower | decoder |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rest = max(0.0, engine_s - enc_s)
    print(f"| batchq engine | {engine_s:.2f} | {n_images / engine_s:,.1f} | {tokens / engine_s:,.0f} | "
          f"{prep_s:.2f} s (threads, overlapped) | {enc_s:.2f} s | {rest:.2f} s |")  # fmt: skip
    print(f"| HF generate, one request at a time | {hf_s:.2f} | {n_images / hf_s:,.1f} | "
          f"{args.requests * args.max_new_tokens / hf_s:,.0f} | {hf_prep:.2f} s | (in generate) | (in generate) |")  # fmt: skip
    print(f"\nsame tokens as HF: {same} / {args.requests} requests")


if __name__ == "__main__":
    main()
