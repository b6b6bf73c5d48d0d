"""Triton paged attention: launchers with the exact signatures of worker.kernels.reference.

The launchers validate their inputs (ValueError on bad shapes, strides, dtypes or devices), pick the
launch parameters and start the kernels in triton_cache, triton_decode and triton_prefill. They never
read device values on the host (no .item(), no max over context_lens), so they do not sync the GPU:
grids are sized from shapes, e.g. the longest context is bounded by max_blocks * block_size.
Values are trusted: slots, block ids and lengths must be in range, as for the reference.

On a machine without a GPU the kernels run on CPU tensors under the Triton interpreter, which must be
switched on (TRITON_INTERPRET=1) before this module is imported, since triton.jit reads it then.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from worker.kernels import triton_cache, triton_decode, triton_invariant, triton_prefill
from worker.kernels import triton_checks as checks

_LOG2E = 1.4426950408889634

# paged_decode_attention's split_tokens for batch-invariant decode (issue 51): splits of a fixed size cut
# each context by its own length only. 512 = 8 tiles of the default block_n (64): long enough that the
# merge stays a small part of a split's work (_auto_splits keeps >= 4 tiles), short enough that one long
# context still spreads over the SMs when few sequences run (8k keys: 16 splits per kv head, 32k: 64).
INVARIANT_SPLIT_TOKENS = 512


def interpreted() -> bool:
    """True when the kernels were built for the Triton interpreter (they then take CPU tensors)."""
    return isinstance(triton_decode.decode_kernel, InterpretedFunction)


def available() -> bool:
    """True when the kernels can run here: a CUDA device, or the interpreter (TRITON_INTERPRET=1)."""
    return torch.cuda.is_available() or interpreted()


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter new keys/values into their slots (slot = block_id * block_size + offset).

    k, v: [tokens, kv_heads, head_dim] (any token/head strides); slot_mapping: [tokens] int32/int64;
    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim] contiguous.
    """
    _, _, kv_heads, head_dim = checks.check_cache(k_cache, v_cache)
    for name, x in (("k", k), ("v", v)):
        checks.check_rows(name, x, 3, kv_heads, head_dim)
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {x.dtype}")
    if v.shape != k.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    checks.check_index("slot_mapping", slot_mapping, (k.shape[0],))
    checks.check_device(k, v, k_cache, v_cache, slot_mapping, cpu_ok=interpreted())
    if k.shape[0] == 0:
        return
    triton_cache.write_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        KV_HEADS=kv_heads, KV_HEADS_PAD=triton.next_power_of_2(kv_heads), HEAD_DIM=head_dim,
    )  # fmt: skip


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    *,
    block_n: int = 64,
    num_splits: int | None = None,
    split_tokens: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    out: Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """One new query token per sequence over its cached context (itself included), its last `window`
    tokens where a window is given; softcap: attention-logit soft-capping; sinks: [heads], a logit per head
    in the softmax's denominator (reference.py's).

    q: [batch, heads, head_dim]; block_tables: [batch, max_blocks]; context_lens: [batch], each >= 1
    -> [batch, heads, head_dim] contiguous, dtype of q, written into `out` when given (a preallocated
    buffer, e.g. for CUDA graphs). num_splits=None picks split-K from the SM count.

    split_tokens (a multiple of block_n; INVARIANT_SPLIT_TOKENS): splits of that many keys from each
    context's first (its window's first, with a window), however many the batch needs, merged by
    triton_invariant.decode_merge_kernel, which sums a sequence's own splits in order: a sequence's result
    is then bitwise the same whatever else is in the batch. Excludes num_splits.
    """
    checks.check_window(window, softcap)
    _, block_size, kv_heads, head_dim = checks.check_cache(k_cache, v_cache)
    checks.check_rows("q", q, 3, None, head_dim)
    batch, heads = q.shape[0], q.shape[1]
    group = checks.check_group(heads, kv_heads)
    checks.check_dtype("q", q, k_cache.dtype)
    checks.check_index("block_tables", block_tables, (batch, None))
    checks.check_index("context_lens", context_lens, (batch,))
    checks.check_device(q, k_cache, v_cache, block_tables, context_lens, cpu_ok=interpreted())
    checks.check_pow2("block_n", block_n, 16)
    out = checks.output(out, q)
    if batch == 0:
        return out
    max_ctx = block_tables.shape[1] * block_size  # host-side bound: no sync on context_lens
    if window is not None:
        max_ctx = min(max_ctx, window)  # the splits cover the window only
    if split_tokens is not None:
        tokens_per_split, num_splits = _fixed_splits(split_tokens, num_splits, max_ctx, block_n)
    else:
        if num_splits is None:
            num_splits = _auto_splits(batch * kv_heads, max_ctx, block_n, q.device)
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        # Whole tiles per split; recompute the count so that no split starts past max_ctx.
        tokens_per_split = triton.cdiv(triton.cdiv(max_ctx, num_splits), block_n) * block_n
        num_splits = max(1, triton.cdiv(max_ctx, tokens_per_split))
    if num_splits > 1:
        part_o = torch.empty((batch, heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((batch, heads, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out  # unused by the kernel when NUM_SPLITS == 1
    sink_rows = _sinks(sinks, heads, q)
    triton_decode.decode_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_o, part_ml, sink_rows,
        scale * _LOG2E, tokens_per_split, window or 0, (softcap or 1.0) * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        HEADS=heads, BLOCK_SIZE=block_size, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        DOT_PRECISION=checks.dot_precision(q.dtype), UPCAST=_upcast(q.dtype),
        WINDOWED=window is not None, SOFTCAP=softcap is not None, SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split_tokens is not None:  # each sequence's own splits, in order (triton_invariant)
        triton_invariant.decode_merge_kernel[(batch, heads)](
            part_o, part_ml, context_lens, out, sink_rows, split_tokens, num_splits, window or 0,
            HEADS=heads, HEAD_DIM=head_dim, WINDOWED=window is not None, SINKS=sinks is not None,
        )  # fmt: skip
    elif num_splits > 1:
        triton_decode.decode_merge_kernel[(batch, heads)](
            part_o, part_ml, out, sink_rows,
            HEADS=heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), SINKS=sinks is not None,
        )  # fmt: skip
    return out


def paged_prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_seqlens_q: Tensor,
    context_lens: Tensor,
    scale: float,
    *,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    out: Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal attention for packed new tokens over their cached prefix and themselves (within `window`
    where given; softcap, sinks: reference.py's).

    q: [new_tokens, heads, head_dim]; cu_seqlens_q: [batch + 1]; context_lens: [batch] (cached prefix +
    new tokens, new K/V already written); block_tables: [batch, max_blocks]
    -> [new_tokens, heads, head_dim] contiguous (into `out` when given). The i-th new token of
    sequence b sits at position context_lens[b] - q_len_b + i. block_m counts rows = tokens x GQA group.
    """
    checks.check_window(window, softcap)
    _, block_size, kv_heads, head_dim = checks.check_cache(k_cache, v_cache)
    checks.check_rows("q", q, 3, None, head_dim)
    tokens, heads = q.shape[0], q.shape[1]
    group = checks.check_group(heads, kv_heads)
    checks.check_dtype("q", q, k_cache.dtype)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q must be [batch + 1], got {tuple(cu_seqlens_q.shape)}")
    batch = cu_seqlens_q.shape[0] - 1
    checks.check_index("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    checks.check_index("block_tables", block_tables, (batch, None))
    checks.check_index("context_lens", context_lens, (batch,))
    checks.check_device(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, cpu_ok=interpreted())
    checks.check_pow2("block_m", block_m, 16)
    checks.check_pow2("block_n", block_n, 16)
    out = checks.output(out, q)
    if tokens == 0 or batch == 0:
        return out
    block_m = max(block_m, triton.next_power_of_2(group))  # a tile holds at least one token's group
    block_q = block_m // group
    triton_prefill.prefill_kernel[(tokens // block_q + batch, kv_heads)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, _sinks(sinks, heads, q),
        scale * _LOG2E, batch, window or 0, (softcap or 1.0) * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        HEADS=heads, BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        DOT_PRECISION=checks.dot_precision(q.dtype), UPCAST=_upcast(q.dtype),
        WINDOWED=window is not None, SOFTCAP=softcap is not None, SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def _sinks(sinks: Tensor | None, heads: int, q: Tensor) -> Tensor:
    """The kernels' sinks: float32 [heads] (q itself where there are none: a pointer they never read)."""
    if sinks is None:
        return q
    if sinks.shape != (heads,):
        raise ValueError(f"sinks must be [{heads}] (one per query head), got {tuple(sinks.shape)}")
    return sinks.to(device=q.device, dtype=torch.float32).contiguous()


# --- launch parameters --------------------------------------------------------------------------------


def _upcast(dtype: torch.dtype) -> bool:
    # The interpreter's tl.dot misreads bfloat16 operands (numpy has no bfloat16): feed it fp32 there.
    return dtype == torch.bfloat16 and interpreted()


def _fixed_splits(split_tokens: int, num_splits: int | None, max_ctx: int, block_n: int) -> tuple[int, int]:
    """split_tokens' (tokens per split, splits): as many splits as the longest context the block table
    holds needs, at least 2 so that decode_kernel always writes partials for the merge. A single split
    would store its result directly, rounded otherwise than by the merge, so a short sequence alone (one
    split) and beside a long one (several) would differ."""
    if num_splits is not None:
        raise ValueError("give num_splits or split_tokens, not both")
    if split_tokens < block_n or split_tokens % block_n:
        raise ValueError(
            f"split_tokens must be a positive multiple of block_n ({block_n}), got {split_tokens}"
        )
    return split_tokens, max(2, triton.cdiv(max_ctx, split_tokens))


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _auto_splits(programs: int, max_ctx: int, block_n: int, device: torch.device) -> int:
    """Split-K only when (sequence, kv head) programs cannot fill the GPU: aim at ~2 waves of programs,
    keep each split at least 4 tiles long so the merge stays cheap, cap at 64 splits. max_ctx is the block
    table's capacity, not the longest context (that would need a sync): tables much wider than the
    contexts give splits that find no tokens; they exit at once, but still cost a launch slot each."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    by_len = max(1, max_ctx // (4 * block_n))
    return max(1, min(math.ceil(2 * sms / programs), by_len, 64))
