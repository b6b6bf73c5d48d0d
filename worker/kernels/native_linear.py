"""The linear layers in C (linear.c) and their packed weight layout; RMSNorm and rotary rows beside them.

y = x W^T + b, W nn.Linear's [out, in] weight stored packed in panels of PANEL outputs (`pack`): float32,
bfloat16, int8 or FP8 E4M3 with a scale per output row, or quantised in groups of input rows (4-bit
unsigned or 8-bit signed q, w = s * q - o with s, o per group and output: GPTQ, AWQ and GGUF's Q4_0, Q4_1,
Q8_0 all take this form). Each panel is streamed once per call and multiplied with every row of x from
registers, where MKL's sgemm runs far below memory bandwidth at decode sizes (`python
benchmarks/kernel_bench.py --linear` compares them).
"""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Mapping
from ctypes import c_float, c_int, c_long, c_void_p
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from worker.kernels.native_build import KERNELS, Signature, cached, load

# linear.c and the files it calls (its header says which does what), linked into one library
SOURCES = tuple(
    KERNELS / name
    for name in (
        "linear.c",
        "linear_dequant.c",
        "linear_decode.c",
        "linear_panels.c",
        "linear_gemm.c",
        "linear_bf16dot.c",
    )
)


class LinearWeightStruct(ctypes.Structure):
    """linear.h's LinearWeight, field for field (tests/kernels/test_native_signatures.py compares them)."""

    _fields_ = [
        *((name, c_void_p) for name in ("w", "scale", "groups", "bias")),
        *((name, c_int) for name in ("elem", "group", "group_elem", "bf16_products")),
    ]


WIDE_ROWS = 3  # linear_panel.h's WIDE_ROWS: the most rows whole-panel tiles take (8-float vectors)
PACE_ROWS = 6  # linear_panel.h's MR with 8-float vectors: the tile fewer rows run through when paced


class LinearTuning(ctypes.Structure):
    """linear.h's LinearTuning, field for field: how linear.c streams the weights on this machine. Which of
    two ways is faster differs between CPUs, so each knob is measured once per machine (`measure_tuning`);
    none changes an answer, only its speed. A value: fixed once made, passed by address to every call.

    prefetch_t0: 1 prefetches the weights into every cache level (prefetcht0), 0 non-temporally;
    far_prefetch: 1 has decode-sized steps also prefetch each line far ahead into L2;
    wide_rows: decode-sized steps of up to this many rows take whole-panel tiles (0 .. WIDE_ROWS);
    pace_rows: decode-sized steps of fewer rows run through tiles of this many (0, off, or PACE_ROWS).
    A knob the build lacks (`tunable`) is ignored by linear.c."""

    _fields_ = [(name, c_int) for name in ("prefetch_t0", "far_prefetch", "wide_rows", "pace_rows")]
    prefetch_t0: int
    far_prefetch: int
    wide_rows: int
    pace_rows: int

    def __init__(self, *args: int, **kwargs: int) -> None:
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "_fixed", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_fixed", False):
            raise AttributeError(f"a LinearTuning is fixed once made: make another (from_dict) for {name}")
        super().__setattr__(name, value)

    @classmethod
    def from_dict(cls, knobs: Mapping[str, int]) -> LinearTuning:
        """The tuning with these knobs by name (one left out is off). ValueError naming the knob where one
        is unknown or its value is not one linear.c has: flags 0 or 1, wide_rows 0 .. WIDE_ROWS, pace_rows
        0 or PACE_ROWS."""
        allowed = {
            "prefetch_t0": (0, 1),
            "far_prefetch": (0, 1),
            "wide_rows": tuple(range(WIDE_ROWS + 1)),
            "pace_rows": (0, PACE_ROWS),
        }
        for name, value in knobs.items():
            if name not in allowed:
                raise ValueError(f"linear tuning: no knob {name!r} (the knobs: {', '.join(allowed)})")
            if not isinstance(value, int) or value not in allowed[name]:
                raise ValueError(f"linear tuning: {name} {value!r}, expected one of {allowed[name]}")
        return cls(**{name: int(value) for name, value in knobs.items()})

    def as_dict(self) -> dict[str, int]:
        return {field[0]: int(getattr(self, field[0])) for field in self._fields_}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LinearTuning) and self.as_dict() == other.as_dict()

    def __hash__(self) -> int:
        return hash(tuple(self.as_dict().values()))

    def __repr__(self) -> str:
        return f"LinearTuning({', '.join(f'{k}={v}' for k, v in self.as_dict().items())})"


DEFAULT_TUNING = LinearTuning()  # every knob off: what linear.c does where nothing was measured

STRUCTS = {"LinearWeight": LinearWeightStruct, "LinearTuning": LinearTuning}  # by their C names

SIGNATURES = {
    "batchq_linear": Signature(c_int, [c_void_p] * 5 + [c_int] * 5 + [c_void_p]),  # then the tuning
    "batchq_linear_w": Signature(c_int, [c_void_p] * 3 + [c_int] * 4 + [c_void_p]),  # the structs by address
    "batchq_rmsnorm": Signature(None, [c_void_p] * 3 + [c_int] * 2 + [c_float]),
    "batchq_silu_mul": Signature(None, [c_void_p, c_void_p, c_int, c_int]),
    "batchq_gelu_mul": Signature(None, [c_void_p, c_void_p, c_int, c_int, c_int]),
    "batchq_rotary": Signature(None, [c_void_p, c_int, c_int, c_long, c_long, c_void_p, c_void_p, c_int]),
    "batchq_fma_probe": Signature(c_int, [c_long, c_int, c_void_p]),
    "batchq_linear_has_bf16dot": Signature(c_int, []),
    "batchq_linear_tunable": Signature(c_int, []),
}
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # linear.c's `elem`
FP8, Q4, Q8 = 3, 4, 5  # linear.h's elem of an FP8 weight and of the group-quantised ones
GROUP_TYPES = {torch.float32: 0, torch.float16: 1}  # linear.h's group_elem
PANEL = 32  # linear.c's PANEL: output columns per panel of a packed weight


@dataclass(frozen=True)
class GroupQuantized:
    """A weight [n, k] quantised in groups of `group` input rows: w = s * q - o, s and o per group and
    output, in linear.c's layout. q: [panels, k, PANEL / 2] uint8 for 4 bits (`pack_q4`), [panels, k, PANEL]
    int8 for 8; groups: [panels, k / group, 2, PANEL] float32 or float16 (`pack_groups`), s then o."""

    q: Tensor
    groups: Tensor
    group: int
    bits: int

    @property
    def elem(self) -> int:
        return Q4 if self.bits == 4 else Q8


def pack_q4(q: Tensor) -> Tensor:
    """4-bit values [n, k] (uint8, 0..15) -> [panels, k, PANEL / 2] uint8: byte j of a panel row holds column
    j in its low nibble and column j + PANEL / 2 in its high one (linear.c's Q4 row)."""
    assert q.dtype == torch.uint8 and int(q.max()) < 16 if q.numel() else True
    p = pack(q)  # [panels, k, PANEL]
    half = PANEL // 2
    return (p[..., :half] | (p[..., half:] << 4)).contiguous()


def unpack_q4(packed: Tensor, n: int) -> Tensor:
    """pack_q4's inverse: -> [n, k] uint8."""
    return unpack(torch.cat((packed & 0xF, packed >> 4), dim=-1), n)


def packed_q4_rows(packed: Tensor, ids: Tensor) -> Tensor:
    """Rows `ids` of the unpacked 4-bit q [N, K], gathered from pack_q4's layout: [T] -> [T, K] uint8."""
    col = ids % PANEL
    half = PANEL // 2
    byte = packed[ids // PANEL, :, col % half]  # [T, K]
    return torch.where((col >= half)[:, None], byte >> 4, byte & 0xF)


def packed_group_rows(packed: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Rows `ids` of s and o [N, groups], gathered from pack_groups' layout: [T] -> 2 x [T, groups]."""
    rows = packed[ids // PANEL, :, :, ids % PANEL]  # [T, groups, 2]
    return rows[..., 0], rows[..., 1]


def pack_groups(s: Tensor, o: Tensor, dtype: torch.dtype) -> Tensor:
    """Scales and offsets [n, groups] -> [panels, groups, 2, PANEL] of `dtype` (zeros past n)."""
    n, g = s.shape
    panels = -(-n // PANEL)
    out = torch.zeros(panels * PANEL, g, 2, dtype=dtype)
    out[:n, :, 0], out[:n, :, 1] = s, o
    return out.view(panels, PANEL, g, 2).permute(0, 2, 3, 1).contiguous()


def unpack_groups(packed: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """pack_groups' inverse: -> s, o [n, groups]."""
    panels, g, _, _ = packed.shape
    flat = packed.permute(0, 3, 1, 2).reshape(panels * PANEL, g, 2)[:n]
    return flat[..., 0].contiguous(), flat[..., 1].contiguous()


def group_quantized(q: Tensor, s: Tensor, o: Tensor, group: int, bits: int) -> GroupQuantized:
    """q [n, k] (uint8 0..15 for 4 bits, int8 for 8), s and o [n, k / group] float32 or float16 ->
    linear.c's layout."""
    assert (
        bits in (4, 8) and q.shape[1] % group == 0 and s.shape == o.shape == (q.shape[0], q.shape[1] // group)
    )
    assert s.dtype == o.dtype and s.dtype in GROUP_TYPES
    packed = pack_q4(q) if bits == 4 else pack(q)
    return GroupQuantized(packed, pack_groups(s, o, s.dtype), group, bits)


def dequantize_groups(gq: GroupQuantized, n: int) -> Tensor:
    """The [n, k] float32 weight: s * q - o, as the reference formula."""
    q = (unpack_q4(gq.q, n) if gq.bits == 4 else unpack(gq.q, n)).float()
    s, o = unpack_groups(gq.groups, n)
    rep = gq.group
    return q * s.float().repeat_interleave(rep, dim=1) - o.float().repeat_interleave(rep, dim=1)


@cached
def library() -> SimpleNamespace | None:
    """The loaded linear kernel (linear.c), or None (with one warning) where it cannot be built."""
    return load(SOURCES, "the linear layers", SIGNATURES)


def has_bf16dot() -> bool:
    """Whether linear.c multiplies bfloat16 weights in bfloat16 here (AVX-512 BF16's VDPBF16PS): the
    batch-invariant bfloat16 engine's linear layers (linear_bf16dot.c)."""
    lib = library()
    return lib is not None and bool(lib.batchq_linear_has_bf16dot())


def tunable() -> frozenset[str]:
    """The knobs of LinearTuning that linear.c, as built here, can change (batchq_linear_tunable's bits, bit i
    field i): prefetch_t0 wherever it loads; far_prefetch, wide_rows and pace_rows with 8-float vectors
    (AVX2 and narrower), whose decode steps take the tiles they tune. None where it cannot be built."""
    lib = library()
    if lib is None:
        return frozenset()
    bits = int(lib.batchq_linear_tunable())
    return frozenset(field[0] for i, field in enumerate(LinearTuning._fields_) if bits >> i & 1)


def measure_tuning(megabytes: int = 96, rounds: int = 5) -> tuple[LinearTuning, dict[str, float]]:
    """This machine's tuning: each knob this build has (`tunable`) timed on and off (`_speedup`) under the
    knobs chosen before it, and taken where it streams faster: the prefetch hint at 1, 4 and 16 rows; under
    that hint the far prefetch, at the same rows; whole-panel tiles at 1 and 3 rows; pacing at the rows of
    1, 3 and 5 that the half-panel tiles then take. Returns the tuning and each measured knob's speedup
    (time off over time on), for a log line. DEFAULT_TUNING, nothing measured, where linear.c cannot be
    built."""
    have = tunable()
    chosen = DEFAULT_TUNING.as_dict()
    speedups: dict[str, float] = {}
    steps: tuple[tuple[str, int, tuple[int, ...]], ...] = (
        ("prefetch_t0", 1, (1, 4, 16)),
        ("far_prefetch", 1, (1, 4, 16)),
        ("wide_rows", WIDE_ROWS, (1, 3)),
        ("pace_rows", PACE_ROWS, (1, 3, 5)),
    )
    for name, on, rows in steps:
        if name not in have:
            continue
        if name == "pace_rows":  # pacing applies to the half-panel tiles only
            rows = tuple(r for r in rows if r > chosen["wide_rows"])
        base, candidate = LinearTuning.from_dict(chosen), LinearTuning.from_dict({**chosen, name: on})
        speedups[name] = _speedup(base, candidate, rows, megabytes, rounds)
        if speedups[name] > 1.0:
            chosen[name] = on
    return LinearTuning.from_dict(chosen), speedups


def _speedup(
    base: LinearTuning, candidate: LinearTuning, rows: tuple[int, ...], megabytes: int, rounds: int
) -> float:
    """How much faster products of `rows` rows over `megabytes` of float32 weights stream under `candidate`
    than under `base`: the time under base over the time under candidate, each the best of `rounds`
    interleaved. The weights are more than most last-level caches hold, so they come from memory as a
    model's do (a CPU with a larger L3 serves part of a small model's from it too)."""
    lib = library()
    assert lib is not None
    k, n = 576, 3072  # a small model's MLP: 6.75 MB a weight
    weights = [pack(torch.randn(n, k)) for _ in range(max(1, megabytes * 2**20 // (4 * k * n)))]
    xs = {m: torch.randn(m, k) for m in rows}
    y = torch.empty(max(rows), n)
    threads = torch.get_num_threads()

    def timed(tuning: LinearTuning) -> float:
        t0 = time.perf_counter()
        for m, x in xs.items():
            for w in weights:
                lib.batchq_linear(x.data_ptr(), w.data_ptr(), None, None, y.data_ptr(), m, k, n, 0, threads,
                                  ctypes.byref(tuning))  # fmt: skip
        return time.perf_counter() - t0

    tunings = (base, candidate)
    for tuning in tunings:
        timed(tuning)  # warm-up: page faults, the thread pool
    best = [math.inf, math.inf]
    for _ in range(rounds):
        for i, tuning in enumerate(tunings):
            best[i] = min(best[i], timed(tuning))
    return best[0] / best[1]


def fma_peak(threads: int, seconds: float = 0.2) -> float:
    """FLOP/s of back-to-back vector FMAs on `threads` threads in the instruction set linear.c was built
    for (BATCHQ_CPU_ISA): the arithmetic ceiling its GEMM tiles are measured against. Best of 3."""
    lib = library()
    assert lib is not None
    sink = torch.zeros(1)
    iters, best = 1 << 16, 0.0
    while True:  # size one call to about `seconds`
        t = time.perf_counter()
        per_round = lib.batchq_fma_probe(iters, threads, sink.data_ptr())
        if time.perf_counter() - t > seconds / 4:
            break
        iters *= 4
    for _ in range(3):
        t = time.perf_counter()
        per_round = lib.batchq_fma_probe(iters, threads, sink.data_ptr())
        best = max(best, 2 * per_round * iters * threads / (time.perf_counter() - t))
    return best


def pack(weight: Tensor) -> Tensor:
    """nn.Linear's weight [N, K] -> linear.c's packed layout [ceil(N / PANEL), K, PANEL] (same dtype):
    panel p holds outputs p * PANEL .. p * PANEL + PANEL - 1, K rows of PANEL contiguous values, zeros
    past N."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype, device=weight.device)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def unpack(packed: Tensor, n: int) -> Tensor:
    """pack's inverse: [panels, K, PANEL] -> [n, K]."""
    panels, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(panels * PANEL, k)[:n].contiguous()


def packed_rows(packed: Tensor, ids: Tensor) -> Tensor:
    """Rows `ids` of the unpacked weight [N, K], gathered from the packed one: [T] -> [T, K]."""
    return packed[ids // PANEL, :, ids % PANEL]


def linear_supports(x: Tensor, weight: Tensor) -> bool:
    """Whether linear.c handles y = x W^T: float32 x on the CPU, a float32, bfloat16 or int8 weight."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and weight_supported(weight)


def weight_supported(weight: Tensor) -> bool:
    """Whether linear.c takes this weight [N, K] (once packed): on the CPU, float32, bfloat16 or int8."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in WEIGHT_TYPES
        and library() is not None
    )


def is_packed(weight: Tensor, n: int, k: int) -> bool:
    """Whether `weight` is a packed [n, k] weight linear.c can read."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in WEIGHT_TYPES
        and weight.shape == (-(-n // PANEL), k, PANEL)
        and weight.is_contiguous()
    )


def linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor | None,
    bias: Tensor | None,
    n: int,
    tuning: LinearTuning = DEFAULT_TUNING,
) -> Tensor:
    """y = x W^T (* scale per output) (+ bias). x: [M, K] float32; weight: W [n, K] packed (`pack`);
    scale, bias: [n] float32 or None (scale required for int8); tuning: this machine's (the backend's).
    -> [M, n] float32. Called once per linear layer per step, so it checks only what is cheap."""
    lib = library()
    assert lib is not None and (scale is not None) == (weight.dtype == torch.int8)
    m, k = x.shape
    assert weight.dim() == 3 and weight.shape[1] == k and weight.shape[0] * PANEL >= n, "pack() the weight"
    x = x.contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    rc = lib.batchq_linear(
        x.data_ptr(), weight.data_ptr(), None if scale is None else scale.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), m, k, n, WEIGHT_TYPES[weight.dtype],
        torch.get_num_threads(), ctypes.byref(tuning),
    )  # fmt: skip
    assert rc == 0, f"linear.c refused [{m}, {k}] x [{n}, {k}] {weight.dtype}"
    return out


def linear_w(
    x: Tensor,
    weight: Tensor | GroupQuantized,
    n: int,
    scale: Tensor | None = None,
    bias: Tensor | None = None,
    bf16_dot: bool = False,
    tuning: LinearTuning = DEFAULT_TUNING,
) -> Tensor:
    """y = x W^T (+ bias) for any weight linear.c reads: what `linear` takes, an FP8 E4M3 weight packed
    with a float32 scale per output, or a group-quantised one. x: [M, K] float32 -> [M, n] float32.
    bf16_dot: multiplied in bfloat16, x and the weight rounded (linear_bf16dot.c; `has_bf16dot` only);
    tuning: this machine's (the backend's)."""
    lib = library()
    assert lib is not None
    m, k = x.shape
    groups: Tensor | None = None
    group = group_elem = 0
    if isinstance(weight, GroupQuantized):
        w, groups, group, elem = weight.q, weight.groups, weight.group, weight.elem
        group_elem = GROUP_TYPES[groups.dtype]
    else:
        w = weight
        elem = FP8 if weight.dtype == torch.float8_e4m3fn else WEIGHT_TYPES[weight.dtype]
    assert w.dim() == 3 and w.shape[1] == k and w.shape[0] * PANEL >= n, "pack the weight"
    x = x.contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    spec = LinearWeightStruct(
        w.data_ptr(), None if scale is None else scale.data_ptr(), None if groups is None else groups.data_ptr(),
        None if bias is None else bias.data_ptr(), elem, group, group_elem, int(bf16_dot),
    )  # fmt: skip
    rc = lib.batchq_linear_w(
        x.data_ptr(),
        ctypes.byref(spec),
        out.data_ptr(),
        m,
        k,
        n,
        torch.get_num_threads(),
        ctypes.byref(tuning),
    )
    assert rc == 0, f"linear.c refused [{m}, {k}] x [{n}, {k}] elem {elem}"
    return out


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Hugging Face's RMSNorm of float32 rows x [T, D] (contiguous) with a float32 weight [D]."""
    lib = library()
    assert lib is not None and x.dtype == torch.float32 and weight.dtype == torch.float32
    x = x.contiguous()
    out = torch.empty_like(x)
    t, d = x.shape
    lib.batchq_rmsnorm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), t, d, eps)
    return out


def silu_mul(gate_up: Tensor, inter: int) -> Tensor:
    """silu(gate) * up for float32 rows gate_up [T, 2 * inter] (gate, then up): [T, inter], the SiLU the
    decode stack computes (within about one float32 rounding of torch's)."""
    lib = library()
    assert lib is not None and gate_up.dtype == torch.float32 and gate_up.shape[-1] == 2 * inter
    gate_up = gate_up.contiguous()
    t = gate_up.shape[0]
    out = torch.empty(t, inter, dtype=torch.float32)
    lib.batchq_silu_mul(gate_up.data_ptr(), out.data_ptr(), t, inter)
    return out


def act_mul(gate_up: Tensor, inter: int, activation: str) -> Tensor:
    """act(gate) * up for float32 rows gate_up [T, 2 * inter]: [T, inter], for spec.ACTIVATIONS' silu,
    gelu_pytorch_tanh and gelu, as the decode stack computes each (each row alike at any T)."""
    if activation == "silu":
        return silu_mul(gate_up, inter)
    lib = library()
    assert lib is not None and gate_up.dtype == torch.float32 and gate_up.shape[-1] == 2 * inter
    assert activation in ("gelu_pytorch_tanh", "gelu"), activation
    gate_up = gate_up.contiguous()
    t = gate_up.shape[0]
    out = torch.empty(t, inter, dtype=torch.float32)
    lib.batchq_gelu_mul(gate_up.data_ptr(), out.data_ptr(), t, inter, int(activation == "gelu_pytorch_tanh"))
    return out


def rotary_(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Rotate float32 x [T, H, D] in place (any row and head strides, unit stride within a head) by the
    contiguous float32 rows cos, sin [T, D]: Hugging Face's rotate-half rotary embedding."""
    lib = library()
    assert lib is not None and x.dtype == cos.dtype == sin.dtype == torch.float32 and x.stride(2) == 1
    assert cos.is_contiguous() and sin.is_contiguous()
    t, h, d = x.shape
    lib.batchq_rotary(x.data_ptr(), t, h, x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), d)
