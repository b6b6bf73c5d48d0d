"""Test grid and paged-cache builder shared by the kernel tests.

Every slot the sequences do not own is garbage: K holds huge values or NaN, V holds NaN, so a kernel that
reads past a context, through a wrong block id or past a block table row, produces NaN or a wrong
softmax. Physical blocks are a shuffled permutation, so no sequence's blocks are contiguous.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from worker.kernels import reference

# Absolute and relative tolerance per dtype. bf16: 8 mantissa bits, and P is rounded to bf16 before P@V.
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


@dataclass(frozen=True)
class Case:
    head_dim: int
    group: int  # query heads per kv head
    kv_heads: int
    block_size: int
    dtype: torch.dtype
    seed: int

    @property
    def heads(self) -> int:
        return self.kv_heads * self.group

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"d{self.head_dim}-g{self.group}-kv{self.kv_heads}-bs{self.block_size}-{dtype}"


f32, bf16 = torch.float32, torch.bfloat16
# A covering array: every pair of values of (group, head_dim, block_size, dtype) appears at least once,
# in 8 cases instead of the 32 of the full product (the interpreter runs a Python loop per program).
GRID = [
    Case(64, 1, 2, 16, f32, seed=1),
    Case(128, 1, 1, 32, bf16, seed=2),
    Case(64, 3, 3, 32, bf16, seed=3),  # SmolLM2-135M: 9 query heads over 3 kv heads
    Case(128, 3, 1, 16, f32, seed=4),
    Case(64, 4, 1, 16, bf16, seed=5),
    Case(128, 4, 2, 32, f32, seed=6),
    Case(64, 8, 1, 32, f32, seed=7),
    Case(128, 8, 2, 16, bf16, seed=8),
]


@dataclass
class PagedCache:
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    context_lens: torch.Tensor  # [batch] int32


def garbage_cache(case: Case, num_blocks: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, case.block_size, case.kv_heads, case.head_dim)
    huge = torch.full(shape, 3.0e4).where(torch.rand(shape, generator=gen) < 0.5, float("nan"))
    return huge.to(case.dtype), torch.full(shape, float("nan"), dtype=case.dtype)


def build_cache(
    case: Case, context_lens: list[int], gen: torch.Generator, device: torch.device
) -> PagedCache:
    """A cache holding fresh random K/V for each sequence's context, garbage everywhere else."""
    bs = case.block_size
    used = [math.ceil(n / bs) for n in context_lens]
    spare = 3  # blocks owned by no sequence: pure garbage
    num_blocks = sum(used) + spare
    perm = torch.randperm(num_blocks, generator=gen)
    # One column more than needed; unused entries point at a garbage block, not at block 0.
    block_tables = torch.full((len(context_lens), max(used) + 1), int(perm[-1]), dtype=torch.int32)
    start = 0
    for b, n in enumerate(used):
        block_tables[b, :n] = perm[start : start + n]
        start += n
    k_cache, v_cache = garbage_cache(case, num_blocks, gen)
    for b, n in enumerate(context_lens):
        pos = torch.arange(n)
        slots = block_tables[b, pos // bs].long() * bs + pos % bs
        k = torch.randn(n, case.kv_heads, case.head_dim, generator=gen)
        v = torch.randn(n, case.kv_heads, case.head_dim, generator=gen)
        reference.write_kv(k, v, k_cache, v_cache, slots)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return PagedCache(k_cache.to(device), v_cache.to(device), block_tables.to(device), lens.to(device))


def random_queries(case: Case, rows: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    # -> [rows, heads, head_dim]
    q = torch.randn(rows, case.heads, case.head_dim, generator=gen)
    return q.to(device=device, dtype=case.dtype)


def poisoned_like(x: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel does not write fails the comparison."""
    return torch.full(
        x.shape, float("nan"), dtype=x.dtype, device=x.device
    )  # contiguous, like the kernels' own


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)
