"""Paged decode attention: Triton kernel vs the torch reference on one CUDA GPU.

    .venv/bin/python benchmarks/kernel_bench.py [--heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16]

For each (batch, context) it checks the kernel against the reference, then times both with
triton.testing.do_bench and prints one table: milliseconds, the speed-up, and the kernel's KV-read
bandwidth (bytes of K and V in the contexts / time), to compare with the GPU's HBM bandwidth.
Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_bench: no CUDA GPU here; the Triton kernels are benchmarked on a GPU only.")
        return 0

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
