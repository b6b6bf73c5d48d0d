"""Batch-invariant kernels (worker/kernels/triton_invariant.py, issue 51): a row's result is bitwise the same
alone and among any number of other rows, at any place among them; and each matches its reference
(F.linear, layers.RMSNorm, reference.paged_decode_attention). On a GPU when there is one, else under the
Triton interpreter.

Each invariance test checks its premise too: the batches really change what a batch-dependent kernel
would change (the GEMM's row count and tiles, the decode's number of splits), and the inputs are such that
summing in another order changes the bits (shown by the kernel itself with tiles or splits that follow
the batch, by a split sum for the norm), so an equality here is no accident of the data.

Under the interpreter a reduction's order is numpy's, not a GPU's: what these tests show there is that
nothing in a row's sums is sized by the batch (tiles, K steps, splits, which splits the merge reads); the
GPU's own reduction trees and MMA order are the GPU run's to confirm.
"""

from __future__ import annotations

import importlib
import math
import sys
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
import triton

from tests.kernels.conftest import ON_GPU, PTXAS, in_fresh_process
from tests.kernels.paged_cases import GRID, Case, PagedCache, assert_close, build_cache, random_queries
from worker.kernels import reference
from worker.models.layers import RMSNorm

ROWS = (1, 3, 16, 33, 130)  # the GEMM's M: one and several row tiles of 128, a row at many offsets in them


@pytest.fixture(scope="module")
def inv(kernels: ModuleType) -> ModuleType:
    """worker.kernels.triton_invariant for the interpreter when there is no GPU (after `kernels`, whose
    triton_attention imports it)."""
    mod = importlib.import_module("worker.kernels.triton_invariant")
    if not ON_GPU and not mod.interpreted():
        mod = importlib.reload(sys.modules["worker.kernels.triton_invariant"])
    return mod


def places(m: int) -> list[int]:
    return sorted({0, m // 2, m - 1})


# --- matmul -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("k", "n", "bias"), [(192, 160, True), (100, 130, False), (37, 20, True)])
def test_matmul_rows_are_bitwise_the_same_in_any_batch(
    inv: ModuleType, device: torch.device, dtype: torch.dtype, k: int, n: int, bias: bool
) -> None:
    # (192, 160): whole K steps, a partial column tile; (100, 130): a K tail of 36; (37, 20): K < one step.
    gen = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=gen).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    row = torch.randn(1, k, generator=gen).to(dtype).to(device)
    alone = inv.matmul(row, w, b)
    assert alone.shape == (1, n) and alone.dtype == dtype

    offsets, tiles = set(), set()
    for m in ROWS:
        for p in places(m):
            x = torch.randn(m, k, generator=gen).to(dtype).to(device)
            x[p] = row[0]
            got = inv.matmul(x, w, b)
            assert torch.equal(got[p], alone[0]), f"row {p} of {m} differs from the row alone"
            offsets.add(p % inv.BLOCK_M)
            tiles.add(triton.cdiv(m, inv.BLOCK_M))
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * math.sqrt(k))
        else:  # F.linear in the 16-bit dtype rounds once or twice: within a few of its ulps
            torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), rtol=1.6e-2, atol=1e-2)
            torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-3 * math.sqrt(k))
    assert len(offsets) > 5 and tiles == {1, 2}  # premise: the row at many places, in one or two row tiles


def test_matmul_tiles_chosen_by_the_batch_would_change_the_bits(
    inv: ModuleType, device: torch.device
) -> None:
    # The control for the test above: the same kernel summing K in steps of 32 rather than 64 (as a GEMM
    # picking its tiles by M might) changes the row's bits on such data; the bitwise checks would see it.
    gen = torch.Generator().manual_seed(5)
    k, n = 192, 160
    w = torch.randn(n, k, generator=gen).to(device)
    x = torch.randn(3, k, generator=gen).to(device)
    fixed = inv.matmul(x, w)
    other = torch.empty_like(fixed)
    inv._launch_matmul(x, w, None, other, 16, 64, 32)
    torch.testing.assert_close(other, fixed, rtol=1e-5, atol=1e-4)
    assert not torch.equal(other, fixed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_matmul_through_tl_dot_matches_f_linear(
    inv: ModuleType, device: torch.device, dtype: torch.dtype
) -> None:
    # Under the interpreter matmul sums a broadcast product (numpy's BLAS behind tl.dot is not
    # row-invariant); the GPU's path, tl.dot, checked for its result here (the interpreter's tl.dot
    # misreads bfloat16, so float32 and float16 only).
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(33, 100, generator=gen).to(dtype).to(device)
    w = torch.randn(130, 100, generator=gen).to(dtype).to(device)
    b = torch.randn(130, generator=gen).to(dtype).to(device)
    got = torch.empty(33, 130, dtype=dtype, device=device)
    inv._launch_matmul(x, w, b, got, inv.BLOCK_M, inv.BLOCK_N, inv.BLOCK_K, broadcast_dot=False)
    want = F.linear(x.float(), w.float(), b.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * 10)


def test_matmul_takes_any_strides_and_leading_dims(inv: ModuleType, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 80, generator=gen).to(device)
    w = torch.randn(50, 80, generator=gen).to(device)
    want = inv.matmul(x.reshape(6, 80), w)
    got = inv.matmul(x, w)
    assert got.shape == (2, 3, 50) and torch.equal(got.reshape(6, 50), want)
    column_major_x = x.reshape(6, 80).t().contiguous().t()
    column_major_w = w.t().contiguous().t()
    assert torch.equal(inv.matmul(column_major_x, column_major_w), want)
    assert inv.matmul(x[:0].reshape(0, 80), w).shape == (0, 50)


def test_matmul_refuses_bad_inputs(inv: ModuleType, device: torch.device) -> None:
    x = torch.zeros(4, 32, device=device)
    w = torch.zeros(8, 32, device=device)
    with pytest.raises(ValueError, match="x dtype"):
        inv.matmul(x.int(), w)
    with pytest.raises(ValueError, match=r"weight must be \[N, 32\]"):
        inv.matmul(x, torch.zeros(8, 16, device=device))
    with pytest.raises(ValueError, match="weight dtype"):
        inv.matmul(x, w.half())
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        inv.matmul(x, w, torch.zeros(9, device=device))
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        inv.matmul(x, w, torch.zeros(8, device=device, dtype=torch.float16))


# --- rmsnorm ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [1000, 4096])
def test_rmsnorm_rows_are_bitwise_the_same_in_any_batch(
    inv: ModuleType, device: torch.device, dtype: torch.dtype, d: int
) -> None:
    gen = torch.Generator().manual_seed(d)
    w = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype).to(device)
    row = (3 * torch.randn(1, d, generator=gen)).to(dtype).to(device)
    for offset in (0.0, 1.0):
        alone = inv.rmsnorm(row, w, 1e-6, offset=offset)
        for t in (1, 7, 64):
            for p in places(t):
                x = (3 * torch.randn(t, d, generator=gen)).to(dtype).to(device)
                x[p] = row[0]
                got = inv.rmsnorm(x, w, 1e-6, offset=offset)
                assert got.dtype == dtype and torch.equal(got[p], alone[0]), f"row {p} of {t} differs"
    # premise: on this data a row's sum of squares taken in another order (two halves) has other bits
    xf = (3 * torch.randn(64, d, generator=gen)).to(dtype).float()
    halves = xf[:, : d // 2].pow(2).sum(-1) + xf[:, d // 2 :].pow(2).sum(-1)
    assert not torch.equal(halves, xf.pow(2).sum(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("plus_one", [False, True], ids=["llama", "gemma"])
def test_rmsnorm_matches_the_model_norm(
    inv: ModuleType, device: torch.device, dtype: torch.dtype, plus_one: bool
) -> None:
    # layers.RMSNorm's torch path: statistics in float32; Llama's w times the row rounded to the dtype,
    # Gemma's (1 + w) in float32 before the one rounding (offset=1.0). The sums' orders differ: float32
    # within 2e-6 relative; 16-bit outputs the same but for a last-bit flip where the float32 value sits
    # on a rounding boundary.
    gen = torch.Generator().manual_seed(7 + plus_one)
    d = 1536
    norm = RMSNorm(d, 1e-5, plus_one=plus_one)
    with torch.no_grad():
        norm.weight.copy_(0.1 * torch.randn(d, generator=gen) + (0 if plus_one else 1))
    norm.to(device=device, dtype=dtype)
    x = (4 * torch.randn(9, d, generator=gen)).to(dtype).to(device)
    want = norm(x)
    got = inv.rmsnorm(x, norm.weight, norm.eps, offset=1.0 if plus_one else 0.0)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=1e-6)
        assert (got != want).float().mean() < 0.01
    # [..., D] rows (Qwen3's per-head norms) and a non-unit row stride
    x3 = x.view(3, 3, d)
    assert torch.equal(inv.rmsnorm(x3, norm.weight, norm.eps, offset=float(plus_one)), got.view(3, 3, d))
    assert torch.equal(inv.rmsnorm(x[::2], norm.weight, norm.eps, offset=float(plus_one)), got[::2])


def test_rmsnorm_refuses_bad_inputs(inv: ModuleType, device: torch.device) -> None:
    x = torch.zeros(2, 64, device=device)
    with pytest.raises(ValueError, match="x dtype"):
        inv.rmsnorm(x.int(), torch.ones(64, device=device), 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        inv.rmsnorm(x, torch.ones(32, device=device), 1e-6)
    with pytest.raises(ValueError, match="D <= 16384"):
        inv.rmsnorm(torch.zeros(1, 16385, device=device), torch.ones(16385, device=device), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        inv.rmsnorm(x, torch.ones(64, device=device), -1.0)


# --- decode with fixed splits -------------------------------------------------------------------------

SPLIT = 128  # 2 tiles of 64 (the interpreter is slow; the engine's INVARIANT_SPLIT_TOKENS is 512)
TARGETS = (50, 300)  # one split (shorter than a split), three (the last partial)


def sub_batch(cache: PagedCache, rows: list[int], bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables and lengths of some of the cache's sequences, the table as wide as they need (+1), as
    the engine sizes it: the batch's longest context sets the kernel's number of splits."""
    lens = cache.context_lens[rows]
    width = max(math.ceil(int(n) / bs) for n in lens) + 1
    return cache.block_tables[rows, :width].contiguous(), lens.contiguous()


def decode_batches(case: Case, device: torch.device, seed: int):
    """A cache holding the targets and 17 neighbours, the first 400 keys long, the rest 1..120; the batches:
    each target after the long neighbour (its splits: 4), amid 5 short ones, and before or amid all 17."""
    gen = torch.Generator().manual_seed(seed)
    others = [400, *(int(n) for n in torch.randint(1, 120, (16,), generator=gen))]
    lens = [*TARGETS, *others]
    cache = build_cache(case, lens, gen, device)
    q = random_queries(case, len(lens), gen, device)
    n = list(range(len(TARGETS), len(lens)))  # the neighbours' rows
    batches = []
    for t in range(len(TARGETS)):
        among_all = [t, *n] if t == 0 else [*n[:9], t, *n[9:]]
        for rows in ([n[0], t], [*n[1:3], t, *n[3:6]], among_all):
            batches.append((t, rows))
    return cache, q, batches


@pytest.mark.parametrize("case", [GRID[4], GRID[6]], ids=str)
def test_decode_with_fixed_splits_is_bitwise_the_same_in_any_batch(
    kernels: ModuleType, inv: ModuleType, device: torch.device, case: Case
) -> None:
    cache, q, batches = decode_batches(case, device, seed=case.seed)
    scale = 1 / math.sqrt(case.head_dim)
    splits = set()

    def decode(rows: list[int], **kw) -> torch.Tensor:
        bt, lens = sub_batch(cache, rows, case.block_size)
        if "split_tokens" in kw:
            splits.add(kernels._fixed_splits(SPLIT, None, bt.shape[1] * case.block_size, 64)[1])
        return kernels.paged_decode_attention(q[rows], cache.k_cache, cache.v_cache, bt, lens, scale, **kw)

    alone = {t: decode([t], split_tokens=SPLIT)[0] for t in range(len(TARGETS))}
    want = reference.paged_decode_attention(
        q[: len(TARGETS)], cache.k_cache, cache.v_cache, cache.block_tables[: len(TARGETS)],
        cache.context_lens[: len(TARGETS)], scale,
    )  # fmt: skip
    for t in range(len(TARGETS)):
        assert_close(alone[t], want[t], case.dtype)
    for t, rows in batches:
        got = decode(rows, split_tokens=SPLIT)
        assert torch.equal(got[rows.index(t)], alone[t]), f"target {t} differs in batch {rows}"
    # premise: the batches change the kernel's number of splits (the targets alone: 2 and 3, beside the
    # 400-key neighbour: 4)
    assert splits == {2, 3, 4}

    # control: splits sized over the batch's longest context (today's num_splits, here 3 of them) move
    # the longer target's split boundaries beside the long neighbour, and its bits change
    rows = [len(TARGETS), 1]
    assert not torch.equal(decode(rows, num_splits=3)[1], decode([1], num_splits=3)[0])


def test_decode_with_fixed_splits_windows_softcaps_and_sinks(
    kernels: ModuleType, inv: ModuleType, device: torch.device
) -> None:
    # The merge's window and sinks: against the reference, and the same bits alone and in a batch.
    case = GRID[2]  # bf16, 9 query heads over 3 kv heads
    cache, q, batches = decode_batches(case, device, seed=21)
    gen = torch.Generator().manual_seed(22)
    sinks = torch.randn(case.heads, generator=gen).to(device)
    opts = {"window": 200, "softcap": 30.0, "sinks": sinks}
    scale = 1 / math.sqrt(case.head_dim)
    alone = {}
    for t, rows in ((0, [0]), (1, [1]), batches[2], batches[-1]):
        bt, lens = sub_batch(cache, rows, case.block_size)
        args = (q[rows], cache.k_cache, cache.v_cache, bt, lens, scale)
        got = kernels.paged_decode_attention(*args, split_tokens=SPLIT, **opts)
        assert_close(got, reference.paged_decode_attention(*args, **opts), case.dtype)
        mine = got[rows.index(t)]
        assert torch.equal(mine, alone.setdefault(t, mine))


def test_decode_split_tokens_is_checked(kernels: ModuleType, device: torch.device) -> None:
    case = GRID[0]
    gen = torch.Generator().manual_seed(1)
    cache = build_cache(case, [10], gen, device)
    q = random_queries(case, 1, gen, device)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.1)
    with pytest.raises(ValueError, match="split_tokens must be a positive multiple of block_n"):
        kernels.paged_decode_attention(*args, split_tokens=100)
    with pytest.raises(ValueError, match="not both"):
        kernels.paged_decode_attention(*args, split_tokens=128, num_splits=2)
    assert kernels.INVARIANT_SPLIT_TOKENS % 64 == 0


# --- the GPU build --------------------------------------------------------------------------------------

SM90 = """
from triton import compile
from triton.compiler import ASTSource
from tests.kernels.hopper_compile import HOPPER
from worker.kernels import triton_invariant as inv

def build(fn, sig, consts, warps, stages, aligned=()):
    sig = {**sig, **{k: "constexpr" for k in consts}}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}  # as a launch's
    return compile(ASTSource(fn, sig, consts, attrs), target=HOPPER,
                   options={"num_warps": warps, "num_stages": stages}).asm["ptx"]

ints = dict.fromkeys(("M", "N", "K", "stride_xm", "stride_wn", "stride_ym"), "i32")
for dt, precision in (("bf16", "tf32"), ("fp32", "ieee")):
    ptrs = dict.fromkeys(("x_ptr", "w_ptr", "bias_ptr", "y_ptr"), "*" + dt)
    ptx = build(inv.matmul_kernel, {**ptrs, **ints},
                {"stride_xk": 1, "stride_wk": 1, "HAS_BIAS": True, "BROADCAST_DOT": False, "BF16_BY_HAND": False,
                 "DOT_PRECISION": precision, "BLOCK_M": inv.BLOCK_M, "BLOCK_N": inv.BLOCK_N,
                 "BLOCK_K": inv.BLOCK_K, "BAND_M": inv.BAND_M},
                inv.GEMM_WARPS, inv.GEMM_STAGES, aligned=(*ptrs, "N", "K", "stride_xm", "stride_wn", "stride_ym"))
    assert ("wgmma" in ptx) == (dt == "bf16"), "bfloat16 GEMM tiles must run on Hopper's wgmma"
for plus in (False, True):
    build(inv.rmsnorm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "D": "i32",
                               "stride_xt": "i32", "eps": "fp32", "offset": "fp32"},
          {"PLUS_OFFSET": plus, "BF16_BY_HAND": False, "BLOCK_D": 16384}, 16, 1)
build(inv.decode_merge_kernel, {"part_o_ptr": "*fp32", "part_ml_ptr": "*fp32", "context_lens_ptr": "*i32",
                                "out_ptr": "*bf16", "sinks_ptr": "*fp32", "split_tokens": "i32",
                                "num_splits": "i32", "window": "i32"},
      {"HEADS": 32, "HEAD_DIM": 128, "WINDOWED": True, "SINKS": True}, 4, 2)
"""


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build ships no ptxas")
def test_invariant_kernels_compile_to_sm90_cubins() -> None:
    # hopper_compile's check for these kernels, in a fresh process (this one may have built them for the
    # interpreter): the compiler rejects what the interpreter lets through, and the bfloat16 GEMM's fixed
    # tiles must land on the tensor cores' wgmma.
    in_fresh_process("-c", SM90)
