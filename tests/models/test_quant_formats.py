"""GPTQ, AWQ and compressed-tensors FP8 linear weights read as batchq keeps them (worker/models/quant_formats.py).

Each test quantises a random weight with the format's published formula and packs it in the format's own
layout (the encoders here follow AutoGPTQ's and AutoAWQ's packing), then checks that batchq's reading gives
back the same integers and scales, that its dequantisation is the reference formula's float32 weight
exactly, and that a Linear holding it (act-order permutation included) computes x times that weight."""

from __future__ import annotations

import pytest
import torch

from tests.quant_checkpoints import AWQ_ORDER, pack_along, quantize_asym  # (AutoAWQ's order, not batchq's)
from tests.quant_checkpoints import dequantize_ref as reference
from worker.kernels import native_linear
from worker.kernels.linear_methods import TORCH_LINEAR, PackedLinear
from worker.models import quant_formats
from worker.models.layers import Linear
from worker.models.quant_formats import QuantConfig


@pytest.mark.parametrize(("bits", "act_order", "v1"), [(4, False, True), (4, True, True), (8, False, True),
                                                       (4, False, False), (8, True, False)])  # fmt: skip
def test_gptq_weights_read_as_the_reference_dequantises_them(bits: int, act_order: bool, v1: bool) -> None:
    gen = torch.Generator().manual_seed(bits * 10 + act_order)
    n, k, group = 48, 256, 64
    w = torch.randn(n, k, generator=gen)
    g_of_k = torch.arange(k) // group
    if act_order:  # each input row's group by its rank in a random order, as desc_act assigns them
        g_of_k = torch.empty(k, dtype=torch.long)
        g_of_k[torch.randperm(k, generator=gen)] = torch.arange(k) // group
    q, scales, zeros = quantize_asym(w, g_of_k, k // group, bits)
    stored_zeros = (zeros - 1) if v1 else zeros  # the original format's off-by-one
    qweight = pack_along(q.t().contiguous(), bits, dim=0)  # [in / per, out]
    qzeros = pack_along(stored_zeros, bits, dim=1)  # [groups, out / per]
    cfg = QuantConfig("gptq", bits, group, gptq_v1_zeros=v1, desc_act=act_order)

    ql = quant_formats.gptq(qweight, qzeros, scales, g_of_k.int(), cfg)

    want = reference(q, scales, zeros, g_of_k)
    assert torch.equal(quant_formats.dequantize(ql), want)
    assert (ql.perm is not None) == act_order
    x = torch.randn(5, k, generator=gen)
    lin = Linear(k, n, bias=False)
    lin.load_groups(ql.q, ql.s, ql.o, ql.group, ql.bits, ql.perm)
    for method in (TORCH_LINEAR, PackedLinear(bf16_gemm_rows=0)):
        if method is not TORCH_LINEAR and native_linear.library() is None:
            continue
        lin.use_method(method)
        assert torch.equal(lin.dequantized(torch.float32), want)
        torch.testing.assert_close(lin(x).double(), x.double() @ want.double().t(), rtol=1e-5, atol=1e-4)


def test_awq_weights_read_as_the_reference_dequantises_them() -> None:
    gen = torch.Generator().manual_seed(5)
    n, k, group = 64, 256, 128
    w = torch.randn(n, k, generator=gen)
    g_of_k = torch.arange(k) // group
    q, scales, zeros = quantize_asym(w, g_of_k, k // group, 4)
    qweight = pack_along(q.t().contiguous(), 4, dim=1, order=AWQ_ORDER)  # [in, out / 8]
    qzeros = pack_along(zeros, 4, dim=1, order=AWQ_ORDER)  # [groups, out / 8]

    ql = quant_formats.awq(qweight, qzeros, scales, QuantConfig("awq", 4, group))

    assert torch.equal(ql.q.long(), q.long())
    assert torch.equal(quant_formats.dequantize(ql), reference(q, scales, zeros, g_of_k))


def test_compressed_tensors_fp8_scales_per_channel_or_tensor() -> None:
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(12, 32, generator=gen).to(torch.float8_e4m3fn)
    _, per_channel = quant_formats.fp8(w, torch.rand(12, 1, generator=gen))
    _, per_tensor = quant_formats.fp8(w, torch.tensor([0.5]))
    assert per_channel.shape == per_tensor.shape == (12,) and bool((per_tensor == 0.5).all())
    with pytest.raises(quant_formats.QuantFormatError, match="per channel or per tensor"):
        quant_formats.fp8(w, torch.rand(12, 4))


def test_quant_configs_are_read_or_refused_by_name() -> None:
    cfg = quant_formats.quant_config
    gptq = type("C", (), {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                                  "desc_act": True}})()  # fmt: skip
    assert cfg(gptq) == QuantConfig("gptq", 4, 32, True, True)
    awq = type("C", (), {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64,
                                                 "version": "gemm", "zero_point": True}})()  # fmt: skip
    assert cfg(awq) == QuantConfig("awq", 4, 64)
    ct = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}},
          "ignore": ["lm_head"]}  # fmt: skip
    assert cfg(type("C", (), {"quantization_config": ct})()) == QuantConfig(
        "fp8", 8, 0, modules_not_converted=("lm_head",)
    )
    assert cfg(type("C", (), {})()) is None
    for bad, words in (({"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
                       ({"quant_method": "gptq", "bits": 3}, "3 bits"),
                       ({"quant_method": "awq", "version": "gemv"}, "'gemv'"),
                       ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                         "config_groups": {"g": {"weights": {}}}}, "'pack-quantized'")):  # fmt: skip
        with pytest.raises(quant_formats.QuantFormatError, match=words):
            cfg(type("C", (), {"quantization_config": bad})())
