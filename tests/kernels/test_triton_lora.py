"""Multi-LoRA shrink and expand: the Triton BGMV kernels (worker/kernels/triton_lora.py) and the torch path
(worker/kernels/lora_ops.py) against a float64 reference, for one row and many, base rows (-1), steps of
base rows only, mixed slots, sizes that are no power of two and that take several reduction steps and
output tiles; float32 and bfloat16 (float16 once). Then batch invariance: a row's bits alone, in a step of
7 and in a step of 64 rows of other slots. On a GPU when there is one, else under the Triton interpreter
(small shapes: it runs each program in Python).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from tests.kernels.conftest import ON_GPU, PTXAS, in_fresh_process
from worker.kernels import lora_ops

Shrink = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Expand = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@pytest.fixture(scope="module")
def lora(kernels: ModuleType) -> ModuleType:
    """worker.kernels.triton_lora for the interpreter when there is no GPU (after `kernels`, which rebuilds
    triton_invariant, whose `rounded` it calls)."""
    mod = importlib.import_module("worker.kernels.triton_lora")
    if not ON_GPU and not mod.interpreted():
        mod = importlib.reload(sys.modules["worker.kernels.triton_lora"])
    return mod


@pytest.fixture(params=["triton", "torch"])
def path(request: pytest.FixtureRequest) -> tuple[Shrink, Expand]:
    if request.param == "torch":
        return lora_ops.lora_shrink_torch, lora_ops.lora_expand_torch
    mod = request.getfixturevalue("lora")
    return mod.lora_shrink, mod.lora_expand


def weights(
    s: int, r: int, k: int, n: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, ...]:
    a = (torch.randn(s, r, k, generator=gen) / k**0.5).to(dtype)
    b = (torch.randn(s, n, r, generator=gen) / r**0.5).to(dtype)
    return a, b


def reference(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    # row by row in float64: x[t] @ a[slot].T, zeros for -1
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[t] = x[t].double() @ a[slot].double().t()
    return out


def pattern(kind: str, t: int, s: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "base":
        return torch.full((t,), -1, dtype=torch.int32)
    if kind == "one":
        return torch.full((t,), s - 1, dtype=torch.int32)
    slots = torch.randint(-1, s, (t,), generator=gen, dtype=torch.int32)
    slots[0], slots[-1] = -1, s - 1  # a base row and a slotted one in every mixed step
    return slots


CASES = [  # (T, in, out, R, S, slots)
    (1, 32, 48, 8, 2, "one"),
    (1, 32, 48, 8, 2, "base"),
    (6, 24, 20, 16, 2, "base"),
    (9, 40, 24, 5, 3, "mixed"),  # nothing a power of two
    (12, 300, 70, 20, 4, "mixed"),  # two shrink steps (the second partial), two rank tiles of 16
    (5, 24, 150, 70, 3, "mixed"),  # two expand steps over R, two output tiles
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("t", "k", "n", "r", "s", "kind"), CASES)
def test_shrink_and_expand_match_float64(
    path: tuple[Shrink, Expand], device: torch.device, dtype: torch.dtype,
    t: int, k: int, n: int, r: int, s: int, kind: str,
) -> None:  # fmt: skip
    shrink, expand = path
    gen = torch.Generator().manual_seed(t * 1000 + k + n + r)
    a, b = weights(s, r, k, n, dtype, gen)
    x = torch.randn(t, k, generator=gen).to(dtype)
    slots = pattern(kind, t, s, gen)
    base = slots < 0

    got = shrink(x.to(device), a.to(device), slots.to(device)).cpu()
    assert got.dtype == torch.float32 and got.shape == (t, r)
    torch.testing.assert_close(got.double(), reference(x, a, slots), rtol=1e-5, atol=1e-6)
    assert torch.equal(got[base], torch.zeros_like(got[base]))  # base rows: exact zeros

    y0 = torch.randn(t, n, generator=gen).to(dtype)
    sr = torch.randn(t, r, generator=gen)  # float32, as the shrink hands it on
    y = y0.to(device, copy=True)
    expand(y, sr.to(device), b.to(device), slots.to(device))
    y = y.cpu()
    want = y0.double() + reference(sr, b, slots)
    assert torch.equal(y[base], y0[base])  # base rows untouched, bit for bit
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-6)
    else:  # y + delta in float32, rounded once: the float64 sum rounded (index_add_ would round twice)
        assert torch.equal(y, want.to(dtype))


def test_float16_and_int64_slots(path: tuple[Shrink, Expand], device: torch.device) -> None:
    shrink, expand = path
    gen = torch.Generator().manual_seed(16)
    t, k, n, r, s = 7, 48, 40, 12, 3
    a, b = weights(s, r, k, n, torch.float16, gen)
    x = torch.randn(t, k, generator=gen).to(torch.float16)
    slots = torch.tensor([2, -1, 0, 1, 2, -1, 0])
    got = shrink(x.to(device), a.to(device), slots.to(device)).cpu()
    torch.testing.assert_close(got.double(), reference(x, a, slots), rtol=1e-5, atol=1e-6)
    y0 = torch.randn(t, n, generator=gen).to(torch.float16)
    y = y0.to(device, copy=True)
    expand(y, got.to(device), b.to(device), slots.to(device))
    assert torch.equal(y.cpu(), (y0.double() + reference(got, b, slots)).to(torch.float16))


def test_expand_adds_into_a_column_slice_in_place(path: tuple[Shrink, Expand], device: torch.device) -> None:
    # LoRA on q_proj adds into q's columns of a fused qkv output: a view whose rows are wider than out.
    _, expand = path
    gen = torch.Generator().manual_seed(4)
    t, n, r, s = 5, 24, 8, 2
    _, b = weights(s, r, 8, n, torch.bfloat16, gen)
    fused0 = torch.randn(t, 3 * n, generator=gen).to(torch.bfloat16)
    sr = torch.randn(t, r, generator=gen)
    slots = torch.tensor([1, -1, 0, 1, 0], dtype=torch.int32)
    fused = fused0.to(device, copy=True)
    expand(fused[:, n : 2 * n], sr.to(device), b.to(device), slots.to(device))
    fused = fused.cpu()
    want = (fused0[:, n : 2 * n].double() + reference(sr, b, slots)).to(torch.bfloat16)
    assert torch.equal(fused[:, n : 2 * n], want)
    assert torch.equal(fused[:, :n], fused0[:, :n]) and torch.equal(fused[:, 2 * n :], fused0[:, 2 * n :])


def test_empty_steps_and_bad_inputs(path: tuple[Shrink, Expand], device: torch.device) -> None:
    shrink, expand = path
    a = torch.zeros(2, 4, 16, device=device)
    b = torch.zeros(2, 8, 4, device=device)
    none = torch.zeros(0, dtype=torch.int32, device=device)
    assert shrink(torch.zeros(0, 16, device=device), a, none).shape == (0, 4)
    expand(torch.zeros(0, 8, device=device), torch.zeros(0, 4, device=device), b, none)
    x, y, sr = (torch.zeros(3, n, device=device) for n in (16, 8, 4))
    slots = torch.zeros(3, dtype=torch.int32, device=device)
    bad_shrink = [
        ((x[:, :8], a, slots), "a_stack must be"),
        ((x, a.half(), slots), "must match x's"),
        ((x, a, slots[:2]), "slots must be"),
        ((x, a, slots.float()), "int32 or int64"),
        ((x.double(), a.double(), slots), "x dtype"),
    ]
    for args, match in bad_shrink:
        with pytest.raises(ValueError, match=match):
            shrink(*args)
    bad_expand = [
        ((y, sr[:, :3], b, slots), "b_stack must be"),
        ((y, sr[:2], b, slots), "y must be"),
        ((y.t(), sr, b, slots), "y must be"),
        ((torch.zeros(8, 3, device=device).t(), sr, b, slots), "unit stride"),
        ((y.half(), sr, b, slots), "must match y's"),
    ]
    for args, match in bad_expand:
        with pytest.raises(ValueError, match=match):
            expand(*args)


def test_the_torch_path_refuses_a_slot_outside_the_stack() -> None:
    # (the kernels do not read slots on the host, so they take [-1, S) on trust)
    a = torch.zeros(2, 4, 16)
    with pytest.raises(ValueError, match=r"\[-1, 2\), got \[2\]"):
        lora_ops.lora_shrink_torch(torch.zeros(2, 16), a, torch.tensor([0, 2]))


# --- batch invariance -------------------------------------------------------------------------------------

K, N, R, S = 300, 70, 20, 5  # two shrink steps, two rank tiles, a partial output tile
PLACES = {7: (0, 3, 6), 64: (0, 29, 63)}


def step(gen: torch.Generator, dtype: torch.dtype, t: int, place: int, row: tuple[torch.Tensor, ...],
         share: bool) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """A step of t rows with `row` (x, y, slot) at `place`, the others random over the slots and -1; share:
    some of them in the row's own slot, else none."""
    x = torch.randn(t, K, generator=gen).to(dtype)
    y = torch.randn(t, N, generator=gen).to(dtype)
    slots = torch.randint(-1, S, (t,), generator=gen, dtype=torch.int32)
    own = int(row[2])
    if share:
        slots[torch.arange(t) % 3 == 1] = own
    else:
        slots[slots == own] = -1
    x[place], y[place], slots[place] = row[0], row[1], own
    return x, y, slots


def one_row(gen: torch.Generator, dtype: torch.dtype, slot: int) -> tuple[torch.Tensor, ...]:
    return (
        torch.randn(K, generator=gen).to(dtype),
        torch.randn(N, generator=gen).to(dtype),
        torch.tensor(slot),
    )


def run(shrink: Shrink, expand: Expand, device: torch.device, a: torch.Tensor, b: torch.Tensor,
        x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    s = shrink(x.to(device), a, slots.to(device))
    out = y.to(device, copy=True)
    expand(out, s, b, slots.to(device))
    return s.cpu(), out.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_rows_bits_do_not_depend_on_the_step(
    lora: ModuleType, device: torch.device, dtype: torch.dtype
) -> None:
    # Alone, among 7 and among 64 rows (some in its own slot, the rest in others or the base), at the start,
    # middle and end of the step: the same bits out of the shrink and out of the expand.
    gen = torch.Generator().manual_seed(51)
    a, b = (w.to(device) for w in weights(S, R, K, N, dtype, gen))
    row = one_row(gen, dtype, 2)
    shrink, expand = lora.lora_shrink, lora.lora_expand
    alone = run(shrink, expand, device, a, b, row[0][None], row[1][None], row[2].view(1).int())
    for t, places in PLACES.items():
        for place in places:
            x, y, slots = step(gen, dtype, t, place, row, share=True)
            s, out = run(shrink, expand, device, a, b, x, y, slots)
            assert torch.equal(s[place], alone[0][0]), f"shrink: row {place} of {t}"
            assert torch.equal(out[place], alone[1][0]), f"expand: row {place} of {t}"


def test_another_reduction_step_would_change_the_bits(lora: ModuleType, device: torch.device) -> None:
    # The control for the test above: on such data the shrink summing in in steps of 64 rather than 256,
    # or the expand summing R in steps of 4 rather than 32, changes a row's bits; so its equalities are no
    # accident of the data, and the steps (fixed by in and R alone) are what keeps them.
    gen = torch.Generator().manual_seed(52)
    a, b = (w.to(device) for w in weights(S, R, K, N, torch.float32, gen))
    x = torch.randn(3, K, generator=gen).to(device)
    slots = torch.tensor([1, -1, 4], dtype=torch.int32, device=device)
    s = lora.lora_shrink(x, a, slots)
    other = torch.empty_like(s)
    lora._launch_shrink(x, a, slots, other, 64)
    torch.testing.assert_close(other, s, rtol=1e-5, atol=1e-6)
    assert not torch.equal(other[0], s[0]) and not torch.equal(other[2], s[2])
    y = torch.randn(3, N, generator=gen).to(device)
    fixed, stepped = y.clone(), y.clone()
    lora.lora_expand(fixed, s, b, slots)
    lora._launch_expand(stepped, s, b, slots, 4)
    torch.testing.assert_close(stepped, fixed, rtol=1e-5, atol=1e-6)
    assert not torch.equal(stepped, fixed)


def test_the_torch_paths_rows_do_not_depend_on_other_slots(device: torch.device) -> None:
    # The torch path runs one matmul a slot: a row whose slot no other row shares has the same bits alone,
    # among 7 and among 64 rows of other slots and the base. Rows that share its slot change that matmul's
    # row count, which torch's CPU GEMMs may follow (lora_ops' caveat): there only closeness is promised.
    gen = torch.Generator().manual_seed(53)
    shrink, expand = lora_ops.lora_shrink_torch, lora_ops.lora_expand_torch
    for dtype in (torch.float32, torch.bfloat16):
        a, b = (w.to(device) for w in weights(S, R, K, N, dtype, gen))
        row = one_row(gen, dtype, 3)
        alone = run(shrink, expand, device, a, b, row[0][None], row[1][None], row[2].view(1).int())
        for t, places in PLACES.items():
            for place in places:
                for share in (False, True):
                    x, y, slots = step(gen, dtype, t, place, row, share)
                    s, out = run(shrink, expand, device, a, b, x, y, slots)
                    if share:
                        torch.testing.assert_close(s[place], alone[0][0], rtol=1e-5, atol=1e-6)
                        torch.testing.assert_close(out[place], alone[1][0], rtol=8e-3, atol=1e-5)
                    else:
                        assert torch.equal(s[place], alone[0][0]) and torch.equal(out[place], alone[1][0])


SM90 = """
from triton import compile
from triton.compiler import ASTSource
from tests.kernels.hopper_compile import HOPPER
from worker.kernels import triton_lora as lora

def build(fn, sig, consts):
    sig = {**sig, **{k: "constexpr" for k in consts}}
    assert compile(ASTSource(fn, sig, consts), target=HOPPER, options={"num_warps": 4, "num_stages": 2}).asm["cubin"]

for dt in ("bf16", "fp32"):
    build(lora.shrink_kernel, {"x_ptr": "*" + dt, "a_ptr": "*" + dt, "slots_ptr": "*i32", "out_ptr": "*fp32",
                               **dict.fromkeys(("R", "K", "stride_xt", "stride_as", "stride_ar"), "i32")},
          {"BLOCK_R": lora.SHRINK_BLOCK_R, "BLOCK_K": lora.SHRINK_BLOCK_K})
    build(lora.expand_kernel, {"y_ptr": "*" + dt, "s_ptr": "*fp32", "b_ptr": "*" + dt, "slots_ptr": "*i32",
                               **dict.fromkeys(("N", "R", "stride_yt", "stride_st", "stride_bs", "stride_bn"), "i32")},
          {"BF16_BY_HAND": False, "BLOCK_N": lora.EXPAND_BLOCK_N, "BLOCK_R": lora.EXPAND_BLOCK_R})
"""


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build ships no ptxas")
def test_lora_kernels_compile_to_sm90_cubins() -> None:
    # hopper_compile's check for these kernels, in a fresh process (this one may have built them for the
    # interpreter): the compiler rejects what the interpreter lets through (the branch on the row's slot,
    # the call into triton_invariant).
    in_fresh_process("-c", SM90)
