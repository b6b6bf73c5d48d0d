"""Paged decode attention: Triton kernel vs the torch reference on one CUDA GPU; on the CPU, the C
kernel (worker/kernels/paged_decode.c) vs the torch path of worker/kernels/cpu.py.

    .venv/bin/python benchmarks/kernel_bench.py [--heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16]
    .venv/bin/python benchmarks/kernel_bench.py --cpu [--heads 9 --kv-heads 3 --head-dim 64 --dtype float32]

GPU: for each (batch, context) it checks the kernel against the reference, then times both with
triton.testing.do_bench and prints one table: milliseconds, the speed-up, and the kernel's KV-read
bandwidth (bytes of K and V in the contexts / time), to compare with the GPU's HBM bandwidth.
Without a GPU it runs the CPU comparison.

CPU: a decode step's attention over `--layers` layers' caches (so reads come from DRAM, as in the
model), sequences of random length 100-850 in shuffled blocks; best of 4 passes, per layer.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import torch

# batch x context: big batches fill the GPU with (sequence, kv head) programs; small ones need split-K.
SHAPES = [(1, 2048), (1, 16384), (4, 8192), (16, 4096), (64, 2048), (128, 1024), (256, 512)]


def make_inputs(
    batch: int, context: int, args: argparse.Namespace, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # -> q [batch, heads, dim], k/v cache [blocks, block_size, kv_heads, dim], block tables, context lens
    dtype = getattr(torch, args.dtype)
    per_seq = math.ceil(context / args.block_size)
    num_blocks = batch * per_seq
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    # Shuffled physical blocks, as a block manager hands them out after some churn.
    block_tables = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(batch, per_seq)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, args.heads, args.head_dim, dtype=dtype, device=device)
    return q, k_cache, v_cache, block_tables, context_lens


def cpu_decode(args: argparse.Namespace) -> int:
    import time

    from worker.kernels import native, reference
    from worker.kernels.torch_attention import TorchAttention

    dtype = getattr(torch, args.dtype)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench import machine

    m = machine()
    print(f"hardware: {m['cpu']}, {m['threads']} threads, torch {m['torch']}")
    print(f"command: {' '.join(sys.argv)}")
    print(
        f"decode: heads {args.heads}, kv heads {args.kv_heads}, head dim {args.head_dim}, "
        f"block size {args.block_size}, {args.dtype}, {args.layers} layers' caches\n"
    )
    if native.library() is None:
        print("kernel_bench: the C kernel is not available here (see the warning above)")
        return 1
    print(f"{'batch':>5} {'tokens':>7} | {'torch ms':>8} {'C ms':>6} {'speed-up':>8} | {'C KV GB/s':>9}")
    gen = torch.Generator().manual_seed(0)
    scale = 1 / math.sqrt(args.head_dim)
    for batch in (8, 32, 64):
        lens = torch.randint(100, 851, (batch,), generator=gen)
        per_seq = (lens + args.block_size - 1) // args.block_size
        num_blocks = int(per_seq.sum())
        order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        tables = torch.zeros(batch, int(per_seq.max()), dtype=torch.int32)
        for i, start in enumerate((per_seq.cumsum(0) - per_seq).tolist()):
            tables[i, : per_seq[i]] = order[start : start + int(per_seq[i])]
        shape = (args.kv_heads, num_blocks, args.block_size, args.head_dim)
        caches = [
            (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
            for _ in range(args.layers)
        ]
        q = torch.randn(batch, args.heads, args.head_dim, generator=gen).to(dtype)
        lens32 = lens.to(torch.int32)
        want = reference.paged_decode_attention(
            q, caches[0][0].permute(1, 2, 0, 3), caches[0][1].permute(1, 2, 0, 3), tables, lens32, scale
        )
        times = {}
        for name, attn in (("torch", TorchAttention(native=False)), ("C", TorchAttention())):
            got = attn.paged_decode_attention(q, *caches[0], tables, lens32, scale)
            err = (got.float() - want.float()).abs().max().item()
            if err > 5e-2:
                print(f"{batch:>5}: the {name} path disagrees with the reference: max abs error {err:.3g}")
                return 1
            best = math.inf
            for _ in range(4):
                t = time.perf_counter()
                for k, v in caches:
                    attn.paged_decode_attention(q, k, v, tables, lens32, scale)
                best = min(best, (time.perf_counter() - t) / args.layers)
            times[name] = best * 1e3
        kv_bytes = 2 * int(lens.sum()) * args.kv_heads * args.head_dim * caches[0][0].element_size()
        print(
            f"{batch:>5} {int(lens.sum()):>7} | {times['torch']:>8.2f} {times['C']:>6.2f} "
            f"{times['torch'] / times['C']:>7.1f}x | {kv_bytes / times['C'] / 1e6:>9.1f}"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU kernels, even where a GPU exists")
    parser.add_argument("--layers", type=int, default=30, help="CPU: layers' caches cycled through")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    if args.cpu or not torch.cuda.is_available():
        return cpu_decode(args)

    import triton.testing

    from worker.kernels import reference, triton_attention

    device = torch.device("cuda")
    print(f"hardware: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print(f"command: {' '.join(sys.argv)}")
    print(
        f"decode: heads {args.heads}, kv heads {args.kv_heads}, head dim {args.head_dim}, "
        f"block size {args.block_size}, {args.dtype}\n"
    )
    print(
        f"{'batch':>5} {'context':>7} | {'reference ms':>12} {'triton ms':>9} {'speed-up':>8} | {'KV GB/s':>7}"
    )
    scale = 1 / math.sqrt(args.head_dim)
    for batch, context in SHAPES:
        inputs = make_inputs(batch, context, args, device)
        want = reference.paged_decode_attention(*inputs, scale)
        got = triton_attention.paged_decode_attention(*inputs, scale)
        err = (got.float() - want.float()).abs().max().item()
        if err > 5e-2:
            print(f"{batch:>5} {context:>7} | kernel disagrees with the reference: max abs error {err:.3g}")
            return 1
        ref_ms = triton.testing.do_bench(functools.partial(reference.paged_decode_attention, *inputs, scale))
        tri_ms = triton.testing.do_bench(
            functools.partial(triton_attention.paged_decode_attention, *inputs, scale)
        )
        kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * inputs[1].element_size()
        print(
            f"{batch:>5} {context:>7} | {ref_ms:>12.3f} {tri_ms:>9.3f} {ref_ms / tri_ms:>7.1f}x | "
            f"{kv_bytes / tri_ms / 1e6:>7.0f}"
        )
        del inputs, want, got
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
