"""Input checks for the Triton launchers (attention, quantised GEMM, MoE): ValueError with a clear message
on bad input; and the dot precision they share.

Only metadata is checked (shapes, strides, dtypes, devices), never tensor values, so no check syncs the GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_cache(k_cache: Tensor, v_cache: Tensor) -> tuple[int, int, int, int]:
    # k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim] -> that shape
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, kv_heads, head_dim], got {k_cache.dim()}-D"
        )
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match "
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype}"
        )
    if k_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"cache dtype must be one of {CACHE_DTYPES}, got {k_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    nb, bs, kvh, d = k_cache.shape
    check_pow2("head_dim", d, 16, 256)
    if bs < 1 or kvh < 1:
        raise ValueError(f"block_size and kv_heads must be >= 1, got {bs} and {kvh}")
    return nb, bs, kvh, d


def check_rows(name: str, x: Tensor, dims: int, heads: int | None, head_dim: int) -> None:
    # x: [tokens, heads, head_dim] with unit stride along head_dim (rows are loaded as vectors).
    if x.dim() != dims or x.shape[-1] != head_dim or (heads is not None and x.shape[1] != heads):
        want = f"[*, {heads if heads is not None else 'heads'}, {head_dim}]"
        raise ValueError(f"{name} must be {want}, got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride along head_dim, got strides {x.stride()}")


def check_group(heads: int, kv_heads: int) -> int:
    if heads < 1 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})")
    return heads // kv_heads


def check_dtype(name: str, x: Tensor, dtype: torch.dtype) -> None:
    if x.dtype != dtype:
        raise ValueError(f"{name} dtype {x.dtype} must match the cache dtype {dtype}")


def check_index(name: str, x: Tensor, shape: tuple[int | None, ...]) -> None:
    # Index tensors: integer, the given shape (None = any size), unit stride along the last dim.
    ok = x.dim() == len(shape) and all(s is None or x.shape[i] == s for i, s in enumerate(shape))
    if not ok:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if x.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {x.dtype}")
    if x.dim() and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride along its last dim, got strides {x.stride()}")


def check_window(window: int | None, softcap: float | None) -> None:
    # a sliding window of at least the query's own key; a positive soft-capping value
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 (keys a query sees, its own included), got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")


def check_pow2(name: str, value: int, low: int, high: int | None = None) -> None:
    if value < low or value & (value - 1) or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be a power of two {bound}, got {value}")


def check_device(*tensors: Tensor, cpu_ok: bool) -> None:
    # cpu_ok: the kernels were built for the Triton interpreter.
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"all tensors must be on one device, got {sorted({str(t.device) for t in tensors})}")
    if device.type == "cpu" and not cpu_ok:
        raise ValueError(
            "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before importing "
            "the worker.kernels.triton_* modules, or pass CUDA tensors"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device}; the Triton kernels take CUDA tensors")


def dot_precision(dtype: torch.dtype) -> str:
    # float32 operands: exact float32 dots. Triton's default is TF32 (10-bit mantissas, ~1e-3 off), which
    # would make a float32 model on the GPU silently less exact than F.linear. 16-bit operands: ignored.
    return "ieee" if dtype == torch.float32 else "tf32"


def output(out: Tensor | None, q: Tensor) -> Tensor:
    # -> [rows, heads, head_dim] contiguous, like q
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or not out.is_contiguous():
        raise ValueError(
            f"out must be contiguous {tuple(q.shape)} {q.dtype} on {q.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device} (contiguous={out.is_contiguous()})"
        )
    return out
