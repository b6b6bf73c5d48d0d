"""The Triton launchers reject malformed inputs with a ValueError that names the problem."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

Args = dict[str, torch.Tensor]


def decode_args(device: torch.device) -> Args:
    k_cache = torch.randn(4, 16, 2, 64, device=device)
    return {
        "q": torch.randn(3, 6, 64, device=device),
        "k_cache": k_cache,
        "v_cache": torch.randn_like(k_cache),
        "block_tables": torch.zeros(3, 2, dtype=torch.int32, device=device),
        "context_lens": torch.ones(3, dtype=torch.int32, device=device),
    }


def cache_like(args: Args, head_dim: int) -> torch.Tensor:
    return args["k_cache"].new_empty(4, 16, 2, head_dim).normal_()


DECODE_ERRORS: list[tuple[str, Callable[[Args], None], str]] = [
    ("heads not a multiple", lambda a: a.update(q=a["q"][:, :5]), "multiple of kv_heads"),
    ("q dtype", lambda a: a.update(q=a["q"].half()), "must match the cache dtype"),
    ("q strided head_dim", lambda a: a.update(q=a["q"].repeat(1, 1, 2)[:, :, ::2]), "unit stride"),
    ("q head_dim differs", lambda a: a.update(q=a["q"][..., :32]), r"q must be \[\*, heads, 64\]"),
    ("head_dim 80", lambda a: a.update(k_cache=cache_like(a, 80), v_cache=cache_like(a, 80)), "power of two"),
    ("cache 3-D", lambda a: a.update(k_cache=a["k_cache"][0]), "num_blocks, block_size"),
    ("caches differ", lambda a: a.update(v_cache=a["v_cache"][:2]), "must match"),
    ("cache int", lambda a: a.update(k_cache=a["k_cache"].int(), v_cache=a["v_cache"].int()), "dtype"),
    (
        "cache not contiguous",
        lambda a: a.update(k_cache=a["k_cache"].mT, v_cache=a["v_cache"].mT),
        "contiguous",
    ),
    ("float block table", lambda a: a.update(block_tables=a["block_tables"].float()), "int32 or int64"),
    ("short context_lens", lambda a: a.update(context_lens=a["context_lens"][:2]), "context_lens"),
]


@pytest.mark.parametrize(
    ("mutate", "message"), [e[1:] for e in DECODE_ERRORS], ids=[e[0] for e in DECODE_ERRORS]
)
def test_decode_rejects(
    kernels: ModuleType, device: torch.device, mutate: Callable[[Args], None], message: str
) -> None:
    args = decode_args(device)
    mutate(args)
    with pytest.raises(ValueError, match=message):
        kernels.paged_decode_attention(*args.values(), 0.125)


def test_decode_rejects_a_wrong_out_buffer(kernels: ModuleType, device: torch.device) -> None:
    args = decode_args(device)
    with pytest.raises(ValueError, match="out must be contiguous"):
        kernels.paged_decode_attention(*args.values(), 0.125, out=torch.empty(3, 6, 64, dtype=torch.float16))


def test_prefill_rejects_cu_seqlens_of_the_wrong_length(kernels: ModuleType, device: torch.device) -> None:
    a = decode_args(device)
    cu_seqlens = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)  # 2 sequences, tables have 3
    with pytest.raises(ValueError, match="block_tables"):
        kernels.paged_prefill_attention(
            a["q"], a["k_cache"], a["v_cache"], a["block_tables"], cu_seqlens, a["context_lens"], 0.125
        )


def test_write_kv_rejects_kv_heads_that_do_not_match_the_cache(
    kernels: ModuleType, device: torch.device
) -> None:
    a = decode_args(device)
    k = torch.randn(3, 1, 64, device=device)
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="k must be"):
        kernels.write_kv(k, k, a["k_cache"], a["v_cache"], slots)


def test_write_kv_rejects_a_slot_mapping_of_another_length(kernels: ModuleType, device: torch.device) -> None:
    a = decode_args(device)
    k = torch.randn(3, 2, 64, device=device)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.write_kv(k, k, a["k_cache"], a["v_cache"], torch.arange(4, device=device))


def test_kernels_report_available_here(kernels: ModuleType) -> None:
    # On a CPU-only machine this is the check that TRITON_INTERPRET was set before the kernels were built.
    assert kernels.available()
