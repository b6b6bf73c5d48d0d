"""The decode attention kernel in C (paged_decode.c), for the torch attention backend on the CPU.

The torch decode path copies every sequence's K/V blocks into a workspace and then reads them again in two
batched matmuls; decode is memory-bound, so that copy is most of its time. The C kernel reads each block in
place, once, on torch's OpenMP threads (`python benchmarks/kernel_bench.py --cpu` compares the two).
"""

from __future__ import annotations

from ctypes import c_float, c_int, c_long, c_void_p
from types import SimpleNamespace

import torch
from torch import Tensor

from worker.kernels.native_build import KERNELS, Signature, cached, load

SOURCES = (KERNELS / "paged_decode.c", KERNELS / "prefill_attention.c")
SIGNATURES = {
    "batchq_paged_decode": Signature(c_int, [c_void_p] * 7 + [c_int] * 10 + [c_float, c_void_p, c_int]),
    "batchq_prefill_attention": Signature(
        c_int, [c_void_p] * 4 + [c_long] * 6 + [c_int] * 6 + [c_float, c_int]
    ),
    "batchq_write_kv": Signature(
        None, [c_void_p, c_long, c_long, c_void_p, c_int, c_int, c_int, c_void_p, c_long, c_int]
    ),
}
MAX_D, MAX_G = 256, 16  # paged_decode.c's limits
PREFILL_MAX_D = 256  # prefill_attention.c's PF_MAX_D; its head_dim must also be a multiple of 16 (a vector)
ELEMENT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}  # paged_decode.c's `elem`


@cached
def library() -> SimpleNamespace | None:
    """The loaded decode attention kernel, or None (with one warning) where it cannot be built."""
    return load(SOURCES, "decode attention", SIGNATURES)


def cache_supported(k_cache: Tensor) -> bool:
    """Whether the kernel reads this cache [KVH, NB, BS, D]: on the CPU, float32, bfloat16 or FP8 E4M3,
    head_dim a multiple of 16 up to MAX_D."""
    d = k_cache.shape[3]
    return (
        k_cache.device.type == "cpu"
        and k_cache.dtype in ELEMENT_TYPES
        and d % 16 == 0
        and d <= MAX_D
        and library() is not None
    )


def supports(q: Tensor, k_cache: Tensor) -> bool:
    """Whether the kernel handles this call: a cache it reads (cache_supported), CPU queries, at most
    MAX_G query heads per kv head."""
    return q.device.type == "cpu" and q.shape[1] // k_cache.shape[0] <= MAX_G and cache_supported(k_cache)


def paged_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    lse: Tensor | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor | None:
    """torch_attention.TorchAttention.paged_decode_attention's contract, caches [KVH, NB, BS, D] (check
    `supports` first). -> [batch, heads, head_dim] in q's dtype (float32 when `lse` is given), or None
    if the kernel could not allocate its scratch memory. `lse`: a contiguous float32 [batch, heads] that
    receives each row's log-sum-exp of its scaled scores (to merge with attention over other keys).
    window, softcap, sinks: reference.py's (the kernel reads no block before a window; a sink joins each
    row's softmax denominator inside the kernel)."""
    assert window is None or window >= 1, window
    assert softcap is None or softcap > 0, softcap
    lib = library()
    assert lib is not None
    b, h, d = q.shape
    kvh, nb, bs, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype
    assert lse is None or (lse.dtype == torch.float32 and lse.is_contiguous() and lse.shape == (b, h))
    qs = (q.float() * scale).contiguous()
    out = torch.empty(b, h, d, dtype=torch.float32)
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    max_len = max(int(lens.max()), 1) if b else 1
    if window is not None:
        max_len = min(max_len, window)  # the scores a row holds: its window's
    sink_rows = None if sinks is None else sinks.float().contiguous()
    assert sink_rows is None or sink_rows.shape == (h,), sink_rows
    rc = lib.batchq_paged_decode(
        qs.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        None if lse is None else lse.data_ptr(), tables.data_ptr(), lens.data_ptr(), b, h, kvh, d, bs, nb,
        tables.shape[1], max_len, ELEMENT_TYPES[k_cache.dtype], window or 0, softcap or 0.0,
        None if sink_rows is None else sink_rows.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        return None
    return out if lse is not None else out.to(q.dtype)


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> bool:
    """torch_attention.TorchAttention.write_kv's contract in one C pass (paged_decode.c's batchq_write_kv)
    where it applies: float32 K and V on the CPU, each head's values contiguous (rows and heads at any
    stride: a fused QKV output's K and V as they are), caches the kernel reads. False: not written."""
    if not (
        k.dtype == v.dtype == torch.float32
        and k.device.type == "cpu"
        and k.stride(-1) == v.stride(-1) == 1
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and cache_supported(k_cache)
        and v_cache.dtype == k_cache.dtype
    ):
        return False
    lib = library()
    assert lib is not None
    kvh, nb, bs, d = k_cache.shape
    t = k.shape[0]
    assert k.shape == v.shape == (t, kvh, d) and slot_mapping.shape == (t,)
    slots = slot_mapping.to(torch.int64).contiguous()
    elem = ELEMENT_TYPES[k_cache.dtype]
    for x, cache in ((k, k_cache), (v, v_cache)):
        lib.batchq_write_kv(
            x.data_ptr(),
            x.stride(0),
            x.stride(1),
            slots.data_ptr(),
            t,
            kvh,
            d,
            cache.data_ptr(),
            nb * bs,
            elem,
        )
    return True


def prefill_supported(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether prefill_attention.c takes this call: float32 on the CPU, head_dim a multiple of 16 up to
    PREFILL_MAX_D, each row's head_dim contiguous and q's heads head_dim apart."""
    d = q.shape[-1]
    return (
        q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.float32
        and d % 16 == 0
        and d <= PREFILL_MAX_D
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and q.stride(1) == d
        and library() is not None
    )


def prefill(
    q: Tensor, k: Tensor, v: Tensor, offset: int, scale: float, out: Tensor | None = None
) -> Tensor | None:
    """Causal attention of one sequence's new queries (prefill_attention.c; check `prefill_supported`):
    q [q_len, heads, D], query j at key position offset + j; k, v [kv_heads, n, D] (any row and head
    strides). -> [q_len, heads, D] float32 (`out` if given: float32, its rows' heads contiguous), or None
    if the kernel could not allocate its scratch."""
    lib = library()
    assert lib is not None
    q_len, h, d = q.shape
    kvh, n, _ = k.shape
    assert offset + q_len <= n and h % kvh == 0, (offset, q_len, n, h, kvh)
    if out is None:
        out = torch.empty(q_len, h, d, dtype=torch.float32)
    assert out.shape == q.shape and out.dtype == torch.float32 and out.stride()[1:] == (d, 1), out.stride()
    rc = lib.batchq_prefill_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), q.stride(0), k.stride(1), k.stride(0),
        v.stride(1), v.stride(0), out.stride(0), q_len, n, offset, h, kvh, d, scale, torch.get_num_threads(),
    )  # fmt: skip
    assert rc != -2, f"prefill_attention.c refused q {tuple(q.shape)}, k {tuple(k.shape)}"
    return out if rc == 0 else None
