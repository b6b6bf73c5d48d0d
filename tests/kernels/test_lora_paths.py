"""A linear layer's LoRA slots (worker/models/lora.py LoraLayer) on each path the backends give it: torch's
ops (backends with neither kernel), lora.c's grouped pass (CPU, float32) and
Triton's (under the interpreter without a GPU). Each equals a float64 reference of base + B(A x) per row,
for adapters of different ranks beside base rows, with fused parts (a pair whose B fills some rows only);
lora.c's rows are bitwise the same alone and among others; Triton's stacks keep one width whatever the
adapters resident, so a row's bits do not follow which other adapters are in the slots."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from types import ModuleType

import pytest
import torch

from tests.kernels.conftest import ON_GPU
from worker.kernels import native_lora
from worker.kernels.backend import TORCH_LORA, LoraGrouped, torch_backend
from worker.models.layers import Linear
from worker.models.lora import LoraLayer, LoraState, LoraStep

IN, OUT, SLOTS, MAX_RANK = 40, 24, 3, 8


def pairs(gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three adapters' (A, B): ranks 2, 5 and 8; the last as two parts (rows 0:10 and 10:24) of ranks 4."""
    out = []
    for r in (2, 5):
        out.append((torch.randn(r, IN, generator=gen), torch.randn(OUT, r, generator=gen) * 0.3))
    a = torch.randn(8, IN, generator=gen)
    b = torch.zeros(OUT, 8)
    b[:10, :4], b[10:, 4:] = torch.randn(10, 4, generator=gen), torch.randn(14, 4, generator=gen)
    out.append((a, b * 0.3))
    return out


def layer(
    backend_grouped: LoraGrouped, seed: int, zero_base: bool = False, device: str = "cpu"
) -> tuple[Linear, LoraState]:
    """A linear of random weights (zeros: its output is the adapters' delta alone) with the three adapters
    of pairs(seed + 1000) in its slots."""
    gen = torch.Generator().manual_seed(seed)
    base = Linear(IN, OUT, bias=True)
    with torch.no_grad():
        base.weight.copy_(torch.randn(OUT, IN, generator=gen) * (0 if zero_base else 1))
        assert base.bias is not None
        base.bias.copy_(torch.randn(OUT, generator=gen) * (0 if zero_base else 1))
    base = base.to(device)
    state = LoraState()
    base.lora = lora = LoraLayer(base, state, SLOTS, MAX_RANK * 2)
    backend = dataclasses.replace(torch_backend(), lora_grouped=backend_grouped)
    for slot, pair in enumerate(pairs(torch.Generator().manual_seed(seed + 1000))):
        lora.install(slot, pair, backend)
    return base, state


def reference(base: Linear, x: torch.Tensor, slots: list[int], seed: int) -> torch.Tensor:
    ps = pairs(torch.Generator().manual_seed(seed + 1000))
    y = x.double() @ base.weight.double().T + base.bias.double()  # type: ignore[union-attr]
    for t, s in enumerate(slots):
        if s >= 0:
            a, b = ps[s]
            y[t] += b.double() @ (a.double() @ x[t].double())
    return y


def grouped_paths(lora: ModuleType | None) -> dict[str, LoraGrouped]:
    paths: dict[str, LoraGrouped] = {"torch": TORCH_LORA}
    if native_lora.library() is not None:
        paths["lora.c"] = LoraGrouped("c", native_lora.lora_grouped, True, False, native_lora.library)
    if lora is not None:
        paths["triton"] = LoraGrouped("triton", lora.lora_grouped, False, True)
    return paths


@pytest.fixture(scope="module")
def lora_mod(kernels: ModuleType) -> ModuleType:
    mod = importlib.import_module("worker.kernels.triton_lora")
    if not ON_GPU and not mod.interpreted():
        mod = importlib.reload(sys.modules["worker.kernels.triton_lora"])
    return mod


def run(
    grouped: LoraGrouped, x: torch.Tensor, slots: list[int], seed: int, zero_base: bool = False
) -> tuple[Linear, torch.Tensor]:
    """The layer's output for rows x of `slots` (on the GPU for Triton where there is one)."""
    device = torch.device("cuda" if grouped.name == "triton" and ON_GPU else "cpu")
    base, state = layer(grouped, seed, zero_base, device.type)
    state.step = LoraStep.of(slots, device)
    with torch.no_grad():
        return base, base(x.to(device)).cpu()


@pytest.mark.parametrize("name", ["torch", "lora.c", "triton"])
def test_every_path_adds_each_rows_adapter(name: str, lora_mod: ModuleType) -> None:
    grouped = grouped_paths(lora_mod).get(name, "missing")
    if grouped == "missing":
        pytest.skip(f"{name} cannot run here (no C compiler)")
    seed, slots = 11, [0, -1, 2, 1, 2, -1, 0]
    x = torch.randn(len(slots), IN, generator=torch.Generator().manual_seed(5))
    base, y = run(grouped, x, slots, seed)  # type: ignore[arg-type]
    want = reference(base.cpu(), x, slots, seed)
    assert torch.allclose(y.double(), want, atol=1e-4, rtol=1e-5), (y.double() - want).abs().max()
    for t, s in enumerate(slots):  # base rows get the base product alone (no delta, not even a zero one)
        if s < 0:
            plain = x[t : t + 1] @ base.weight.cpu().T + base.bias.cpu()  # type: ignore[union-attr]
            assert torch.allclose(y[t], plain[0], atol=1e-5)


def test_lora_c_rows_do_not_depend_on_their_neighbours() -> None:
    if native_lora.library() is None:
        pytest.skip("no C compiler")
    grouped = LoraGrouped("c", native_lora.lora_grouped, True, False, native_lora.library)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(64, IN, generator=gen)
    slots = [int(s) for s in torch.randint(-1, SLOTS, (64,), generator=gen)]
    slots[10] = 2
    # a zero base: the output is the delta alone (torch's own GEMM, the base product here, may round by rows)
    _, among = run(grouped, x, slots, 3, zero_base=True)
    _, alone = run(grouped, x[10:11], [2], 3, zero_base=True)
    assert torch.equal(among[10], alone[0])


def test_triton_stacks_keep_one_width_whatever_is_resident(lora_mod: ModuleType) -> None:
    grouped = LoraGrouped("triton", lora_mod.lora_grouped, False, True)
    base, _ = layer(grouped, 1)
    assert isinstance(base.lora, LoraLayer) and base.lora.a_stack is not None
    assert base.lora.a_stack.shape == (SLOTS, MAX_RANK * 2, IN)
    c = LoraGrouped("c", native_lora.lora_grouped, True, False, native_lora.library)
    narrow, _ = layer(c, 1)
    assert isinstance(narrow.lora, LoraLayer) and narrow.lora.b_stack is not None
    assert narrow.lora.b_stack.shape == (SLOTS, 8, OUT)  # the widest resident pair's ranks, B transposed
