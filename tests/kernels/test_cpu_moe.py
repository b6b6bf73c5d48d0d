"""The C grouped MoE kernel (moe.c) against the torch reference (moe_methods.experts_reference) over a grid of
shapes: tokens 1..40, 4 to 8 experts, top-k 1, 2 and 4, both activations, biased and not, float32 and
bfloat16 experts; and its refusal of an expert index out of range."""

from __future__ import annotations

import pytest
import torch

from worker.kernels import native_linear, native_moe
from worker.kernels.experts import ExpertActivation, Experts
from worker.kernels.moe_methods import PackedMoE, experts_reference

pytestmark = pytest.mark.skipif(native_moe.library() is None, reason="no C compiler here")
SILU = ExpertActivation("silu")
SWIGLU = ExpertActivation("clamped_swiglu", 1.702, 1.5)  # a low limit, so the clamps bite


def routed(gen: torch.Generator, t: int, e: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (a router's top-k) and positive weights."""
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    return ids, torch.rand(t, k, generator=gen) + 0.1


@pytest.mark.parametrize("t", [1, 2, 3, 7, 16, 40])
@pytest.mark.parametrize(("e", "k"), [(4, 1), (4, 2), (8, 2), (8, 4), (6, 4)])
@pytest.mark.parametrize(("h", "inter"), [(64, 32), (40, 72)])
def test_grouped_experts_match_the_torch_reference(t: int, e: int, k: int, h: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(t * 100 + e * 10 + k)
    x = torch.randn(t, h, generator=gen)
    gate_up = torch.randn(e, 2 * inter, h, generator=gen) / h**0.5
    down = torch.randn(e, h, inter, generator=gen) / inter**0.5
    ids, w = routed(gen, t, e, k)
    biased = (t + k) % 2 == 0
    gu_bias = torch.randn(e, 2 * inter, generator=gen) if biased else None
    d_bias = torch.randn(e, h, generator=gen) if biased else None
    experts = Experts(gate_up, down, SWIGLU if biased else SILU, gu_bias, d_bias)
    method = PackedMoE()
    ours = method.apply(x, ids, w, experts._replace(gate_up=method.store(gate_up), down=method.store(down)))
    ref = experts_reference(x, ids, w, experts)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_bfloat16_experts_widen_as_they_are_read() -> None:
    gen = torch.Generator().manual_seed(5)
    t, e, k, h, inter = 9, 8, 2, 64, 48
    x = torch.randn(t, h, generator=gen)
    gate_up = (torch.randn(e, 2 * inter, h, generator=gen) / h**0.5).bfloat16()
    down = (torch.randn(e, h, inter, generator=gen) / inter**0.5).bfloat16()
    ids, w = routed(gen, t, e, k)
    method = PackedMoE()
    ours = method.apply(x, ids, w, Experts(method.store(gate_up), method.store(down), SILU))
    ref = experts_reference(x, ids, w, Experts(gate_up.float(), down.float(), SILU))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_linear_c_tuning_changes_no_experts_answer() -> None:
    # PackedMoE passes the backend's tuning to moe.c's linear.c products: only their speed depends on it
    gen = torch.Generator().manual_seed(6)
    t, e, k, h, inter = 5, 4, 2, 64, 48
    x = torch.randn(t, h, generator=gen)
    gate_up, down = torch.randn(e, 2 * inter, h, generator=gen), torch.randn(e, h, inter, generator=gen)
    ids, w = routed(gen, t, e, k)
    tuning = native_linear.LinearTuning(1, 1, native_linear.WIDE_ROWS, native_linear.PACE_ROWS)
    default, tuned = (
        m.apply(x, ids, w, Experts(m.store(gate_up), m.store(down), SILU))
        for m in (PackedMoE(), PackedMoE(tuning))
    )
    assert torch.equal(default, tuned)


def test_packed_experts_unpack_to_themselves() -> None:
    w = torch.randn(3, 40, 24)
    assert torch.equal(native_moe.unpack_experts(native_moe.pack_experts(w), 40), w)


def test_an_expert_index_out_of_range_is_refused() -> None:
    method = PackedMoE()
    experts = Experts(method.store(torch.randn(4, 16, 8)), method.store(torch.randn(4, 8, 8)), SILU)
    ids = torch.tensor([[0, 4]])
    with pytest.raises(AssertionError, match="expert id out of range"):
        method.apply(torch.randn(1, 8), ids, torch.ones(1, 2), experts)
