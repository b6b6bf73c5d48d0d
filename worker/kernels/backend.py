"""Attention backend selection: Triton kernels on CUDA when they import, pure torch otherwise.

Every backend exposes reference.py's three functions with exactly its signatures.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.kernels import cpu, reference

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]


def torch_backend() -> AttentionBackend:
    return AttentionBackend(
        "torch", reference.write_kv, cpu.paged_decode_attention, cpu.paged_prefill_attention
    )


def triton_backend() -> AttentionBackend:
    """Raises ImportError / AttributeError when the Triton kernels are missing or incomplete."""
    mod = importlib.import_module("worker.kernels.triton_attention")
    return AttentionBackend(
        "triton",
        getattr(mod, "write_kv", reference.write_kv),
        mod.paged_decode_attention,
        mod.paged_prefill_attention,
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
