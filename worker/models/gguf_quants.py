"""GGUF's quantised tensors as group-quantised weights, without dequantising them.

Every block format here is, per output row, groups of consecutive input values with w = s * q - o: q a
small integer, s and o per group (Q4_0: s = d, o = 8d; Q4_1: s = d, o = -m; Q8_0: s = d, o = 0; the 5-bit
and 6-bit ones as 8-bit q; the K-quants' sub-block scales folded into s and o). linear.c computes s * q - o
with one rounding, which for every format here is the float32 value gguf's own dequantisation gives (the
products are exact: an f16 scale, times a sub-block's scale of at most 8 bits, times q of at most 6), so
a model served from the quantised file computes with the very weights the dequantised file holds.

s and o stay float16 where they are f16 values in the file (the legacy formats: half a bit or a bit per
weight, as in the file); the K-quants' d * sc products need float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256  # a K-quant super-block


@dataclass(frozen=True)
class Quantized:
    """q [n, k] (uint8 0..15 for bits 4, int8 for bits 8), s and o [n, k / group]: w = s * q - o."""

    q: np.ndarray
    s: np.ndarray
    o: np.ndarray
    group: int
    bits: int


# bytes per block and values per block, by GGUF type name
BLOCKS = {
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q5_0": (22, 32),
    "Q5_1": (24, 32),
    "Q8_0": (34, 32),
    "Q4_K": (144, QK_K),
    "Q5_K": (176, QK_K),
    "Q6_K": (210, QK_K),
}


F16_GROUPS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # whose s and o are float16 values in the file


def supported(type_name: str) -> bool:
    return type_name in BLOCKS


def decode(raw: np.ndarray, type_name: str, k: int) -> Quantized:
    """A GGUF tensor's blocks, raw [n, k / values * bytes] uint8 (n rows of k values), as a Quantized."""
    size, values = BLOCKS[type_name]
    n = raw.shape[0]
    if k % values or raw.shape[1] != k // values * size:
        raise ValueError(f"{type_name}: rows of {raw.shape[1]} bytes do not hold {k} values")
    b = np.ascontiguousarray(raw).reshape(n, k // values, size)
    return _DECODERS[type_name](b, n, k)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of every block: [n, blocks]."""
    return np.ascontiguousarray(b[..., at : at + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: byte j's low nibble is value j, its high one value j + 16."""
    return np.concatenate((qs & 0xF, qs >> 4), axis=-1)


def _q4_0(b: np.ndarray, n: int, k: int) -> Quantized:
    d = _f16(b, 0)
    q = _nibbles(b[..., 2:18]).reshape(n, k)
    return Quantized(q, d, d * np.float16(8), 32, 4)


def _q4_1(b: np.ndarray, n: int, k: int) -> Quantized:
    q = _nibbles(b[..., 4:20]).reshape(n, k)
    return Quantized(q, _f16(b, 0), -_f16(b, 2), 32, 4)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes of 32 bits -> [..., 32] bits, value j's bit j (little-endian)."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits.astype(np.uint8)


def _q5_0(b: np.ndarray, n: int, k: int) -> Quantized:
    d = _f16(b, 0)
    q = (_nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6]) << 4)).astype(np.int16) - 16
    return Quantized(q.astype(np.int8).reshape(n, k), d, np.zeros_like(d), 32, 8)


def _q5_1(b: np.ndarray, n: int, k: int) -> Quantized:
    q = _nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8]) << 4)
    return Quantized(q.astype(np.int8).reshape(n, k), _f16(b, 0), -_f16(b, 2), 32, 8)


def _q8_0(b: np.ndarray, n: int, k: int) -> Quantized:
    d = _f16(b, 0)
    q = np.ascontiguousarray(b[..., 2:34]).view(np.int8).reshape(n, k)
    return Quantized(q, d, np.zeros_like(d), 32, 8)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 8 sub-blocks' 6-bit scales and mins, packed in 12 bytes: [..., 12] -> 2 x [..., 8]."""
    s = scales.astype(np.uint8)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate((lo_sc, hi_sc), axis=-1), np.concatenate((lo_m, hi_m), axis=-1)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: per sub-block of 32, s = d * sc and o = dmin * m in float32: [n, blocks, 8]."""
    d, dmin = _f16(b, 0).astype(np.float32), _f16(b, 2).astype(np.float32)
    sc, m = _scale_min_k4(b[..., 4:16])
    return d[..., None] * sc.astype(np.float32), dmin[..., None] * m.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: [..., 128] bytes -> [..., 8, 32] low 4 bits: 4 chunks of 32 bytes, each the low nibbles
    of one sub-block and the high nibbles of the next."""
    c = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack((c & 0xF, c >> 4), axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(b: np.ndarray, n: int, k: int) -> Quantized:
    s, o = _k_scales(b)
    q = _k_nibbles(b[..., 16:144])
    return Quantized(q.reshape(n, k), s.reshape(n, -1), o.reshape(n, -1), 32, 4)


def _q5_k(b: np.ndarray, n: int, k: int) -> Quantized:
    s, o = _k_scales(b)
    low = _k_nibbles(b[..., 48:176])
    qh = b[..., 16:48]  # bit j of byte l: the fifth bit of sub-block j's value l
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [n, blocks, 8, 32]
    q = (low | (high << 4)).astype(np.int8)
    return Quantized(q.reshape(n, k), s.reshape(n, -1), o.reshape(n, -1), 32, 8)


def _q6_k(b: np.ndarray, n: int, k: int) -> Quantized:
    ql, qh = b[..., 0:128], b[..., 128:192]
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)  # [n, blocks, 16]
    d = _f16(b, 208).astype(np.float32)
    ql = ql.reshape(*ql.shape[:-1], 2, 64)  # two halves of 128 values
    qh = qh.reshape(*qh.shape[:-1], 2, 32)
    low = np.stack((ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4), axis=-2)
    high = np.stack([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-2)  # [n, blocks, 2, 4, 32]
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    s = d[..., None] * sc
    return Quantized(q.reshape(n, k), s.reshape(n, -1), np.zeros_like(s).reshape(n, -1), 16, 8)


_DECODERS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def dequantize(qt: Quantized) -> np.ndarray:
    """The float32 weight [n, k]: s * q - o, rounded once (as linear.c's fused multiply-add does)."""
    s = np.repeat(qt.s.astype(np.float64), qt.group, axis=1)
    o = np.repeat(qt.o.astype(np.float64), qt.group, axis=1)
    return (s * qt.q.astype(np.float64) - o).astype(np.float32)
