"""GGUF block formats decoded into group-quantised weights (worker/models/gguf_quants.py) give, through
s * q - o rounded once (linear.c's formula), exactly the float32 values of gguf's own dequantisation: on
random blocks of every format, and through linear.c itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from worker.kernels import native_linear
from worker.models import gguf_quants

F16_FIELDS = {  # byte offsets of each block's float16 fields: kept finite and of sane size
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    size, values = gguf_quants.BLOCKS[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    for at in F16_FIELDS[type_name]:
        f = (rng.standard_normal((n, k // values)) * 0.02).astype(np.float16)
        raw[..., at : at + 2] = f[..., None].view(np.uint8).reshape(n, k // values, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("type_name", sorted(gguf_quants.BLOCKS))
def test_decoded_blocks_dequantise_to_ggufs_own_values(type_name: str) -> None:
    n, k = 7, 512
    raw = random_blocks(type_name, n, k, seed=len(type_name))
    qt = gguf_quants.decode(raw, type_name, k)
    want = gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(n, k)

    assert qt.q.shape == (n, k) and qt.s.shape == qt.o.shape == (n, k // qt.group)
    assert qt.q.dtype == (np.uint8 if qt.bits == 4 else np.int8)
    if qt.bits == 4:
        assert int(qt.q.max()) <= 15
    np.testing.assert_array_equal(gguf_quants.dequantize(qt), want.astype(np.float32))


@pytest.mark.skipif(native_linear.library() is None, reason="no C compiler here")
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_linear_c_multiplies_by_ggufs_dequantised_weights(type_name: str) -> None:
    """Through the kernel, the products equal those with the dequantised float32 weights: the same values,
    summed in the same order (the float32 kernel on gguf's dequantised weight)."""
    n, k = 45, 512
    raw = random_blocks(type_name, n, k, seed=3)
    qt = gguf_quants.decode(raw, type_name, k)
    w = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(n, k).copy())
    gq = native_linear.group_quantized(
        torch.from_numpy(qt.q), torch.from_numpy(qt.s), torch.from_numpy(qt.o), qt.group, qt.bits
    )
    for m in (1, 5, 70):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got = native_linear.linear_w(x, gq, n)
        assert torch.equal(got, native_linear.linear_w(x, native_linear.pack(w), n)), (type_name, m)


def test_a_tensor_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ValueError, match="do not hold 64 values"):
        gguf_quants.decode(np.zeros((2, 35), dtype=np.uint8), "Q8_0", 64)
