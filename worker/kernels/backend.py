"""Attention backend selection: Triton kernels on CUDA when they import, pure torch otherwise.

Every backend exposes reference.py's three functions with its signatures, plus the cache layout it
wants (`kv_cache_shape`). Prefill also receives this step's new k/v; a backend may attend to them
directly instead of reading them back from the cache (the CPU path does, the Triton kernel reads the
cache).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from worker.kernels import reference
from worker.kernels.torch_attention import TorchAttention

log = logging.getLogger(__name__)


def reference_kv_cache_shape(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    return (num_blocks, block_size, kv_heads, head_dim)


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    kv_cache_shape: Callable[[int, int, int, int], tuple[int, ...]]  # (blocks, block_size, kv_heads, dim)
    write_kv: Callable[..., None]
    paged_decode_attention: Callable[..., Tensor]
    # (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, k=new_k, v=new_v)
    paged_prefill_attention: Callable[..., Tensor]
    # (k_cache, block_tables, context_lens) -> whether this decode step's attention would be the plain C
    # kernel of paged_decode.c, so that the model may run the whole step in C (decode_stack.c); None:
    # never
    plain_native_decode: Callable[[Tensor, Tensor, Tensor], bool] | None = None


def torch_backend() -> AttentionBackend:
    attn = TorchAttention()
    return AttentionBackend(
        "torch",
        attn.kv_cache_shape,
        attn.write_kv,
        attn.paged_decode_attention,
        attn.paged_prefill_attention,
        attn.plain_native_decode,
    )


def _prefill_from_cache(mod: ModuleType) -> Callable[..., Tensor]:
    def prefill(*args: object, k: Tensor | None = None, v: Tensor | None = None) -> Tensor:
        out: Tensor = mod.paged_prefill_attention(*args)
        return out

    return prefill


def triton_backend() -> AttentionBackend:
    """Raises ImportError / AttributeError when the Triton kernels are missing or incomplete."""
    mod = importlib.import_module("worker.kernels.triton_attention")
    return AttentionBackend(
        "triton",
        reference_kv_cache_shape,
        getattr(mod, "write_kv", reference.write_kv),
        mod.paged_decode_attention,
        _prefill_from_cache(mod),
    )


def select_backend(device: torch.device, requested: str = "auto") -> AttentionBackend:
    """requested: auto | torch | triton. auto = triton on CUDA when importable, else torch."""
    if requested == "torch":
        return torch_backend()
    if requested == "triton":
        if device.type != "cuda":
            raise ValueError("attention_backend 'triton' needs a CUDA device")
        return triton_backend()
    if requested != "auto":
        raise ValueError(f"unknown attention backend {requested!r} (auto, torch or triton)")
    if device.type == "cuda":
        try:
            return triton_backend()
        except (ImportError, AttributeError) as exc:
            log.warning("Triton attention unavailable (%s); using the torch path", exc)
    return torch_backend()
