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
import time
from ctypes import c_float, c_int, c_long, c_void_p
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor

from worker.kernels.native_build import KERNELS, Signature, cached, load

SOURCES = (KERNELS / "linear.c", KERNELS / "linear_bf16dot.c")


class LinearWeightStruct(ctypes.Structure):
    """linear.h's LinearWeight, field for field (tests/kernels/test_native_signatures.py compares them)."""

    _fields_ = [
        *((name, c_void_p) for name in ("w", "scale", "groups", "bias")),
        *((name, c_int) for name in ("elem", "group", "group_elem", "bf16_products")),
    ]


STRUCTS = {"LinearWeight": LinearWeightStruct}  # by their C names

SIGNATURES = {
    "batchq_linear": Signature(c_int, [c_void_p] * 5 + [c_int] * 5),
    "batchq_linear_w": Signature(c_int, [c_void_p] * 3 + [c_int] * 4),  # the LinearWeight by address
    "batchq_rmsnorm": Signature(None, [c_void_p] * 3 + [c_int] * 2 + [c_float]),
    "batchq_silu_mul": Signature(None, [c_void_p, c_void_p, c_int, c_int]),
    "batchq_gelu_mul": Signature(None, [c_void_p, c_void_p, c_int, c_int, c_int]),
    "batchq_rotary": Signature(None, [c_void_p, c_int, c_int, c_long, c_long, c_void_p, c_void_p, c_int]),
    "batchq_fma_probe": Signature(c_int, [c_long, c_int, c_void_p]),
    "batchq_linear_has_bf16dot": Signature(c_int, []),
    "batchq_linear_set_wide_rows": Signature(c_int, [c_int]),
    "batchq_linear_set_prefetch_t0": Signature(c_int, [c_int]),
    "batchq_linear_set_far_prefetch": Signature(c_int, [c_int]),
    "batchq_linear_set_pace_rows": Signature(c_int, [c_int]),
}
# linear.c's settings (`configure`), which every library linked with linear.c binds beside its own functions
SETTING_SIGNATURES = {
    name: SIGNATURES[name]
    for name in (
        "batchq_linear_set_wide_rows",
        "batchq_linear_set_prefetch_t0",
        "batchq_linear_set_far_prefetch",
        "batchq_linear_set_pace_rows",
    )
}
WIDE_ROWS = 3  # linear.c's WIDE_ROWS: the most rows whole-panel tiles take (8-float vectors)
PACE_ROWS = 6  # linear.c's MR with 8-float vectors: the tile fewer rows run through when paced
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
    return configure(load(SOURCES, "the linear layers", SIGNATURES))


# Every loaded library with linear.c in it (this module's, the decode stack's, the MoE kernel's): each has
# its own copy of linear.c's settings, so a setting goes to all of them, and to each loaded later.
_LINKED: list[SimpleNamespace] = []
_wide_rows = 0
_prefetch_t0 = False
_far_prefetch = False
_pace_rows = 0


def configure(lib: SimpleNamespace | None) -> SimpleNamespace | None:
    """A just-loaded library linked with linear.c, given the settings in force (`set_wide_rows`,
    `set_prefetch_t0`, `set_far_prefetch`, `set_pace_rows`)."""
    if lib is not None:
        _give_settings(lib)
        _LINKED.append(lib)
    return lib


def _give_settings(lib: SimpleNamespace) -> None:
    """Sets the settings in force in `lib`'s copy of linear.c."""
    lib.batchq_linear_set_wide_rows(_wide_rows)
    lib.batchq_linear_set_prefetch_t0(int(_prefetch_t0))
    lib.batchq_linear_set_far_prefetch(int(_far_prefetch))
    lib.batchq_linear_set_pace_rows(_pace_rows)


def has_bf16dot() -> bool:
    """Whether linear.c multiplies bfloat16 weights in bfloat16 here (AVX-512 BF16's VDPBF16PS): the
    batch-invariant bfloat16 engine's linear layers (linear_bf16dot.c)."""
    lib = library()
    return lib is not None and bool(lib.batchq_linear_has_bf16dot())


def has_wide_tiles() -> bool:
    """Whether linear.c, as built here, chooses between whole-panel and half-panel tiles (8-float vectors:
    AVX2 and narrower; a 16-float tile spans the whole panel anyway)."""
    lib = library()
    if lib is None:
        return False
    available = int(lib.batchq_linear_set_wide_rows(WIDE_ROWS)) > 0
    lib.batchq_linear_set_wide_rows(_wide_rows)
    return available


def wide_rows() -> int:
    """The rows up to which decode-sized steps take whole-panel tiles (`set_wide_rows`; 0: none)."""
    return _wide_rows


def set_wide_rows(rows: int) -> None:
    """Decode-sized steps of up to `rows` rows take whole-panel tiles, in every library with linear.c (the
    answers are the same either way, bit for bit: only the speed differs). Set before the kernels run."""
    global _wide_rows
    if not 0 <= rows <= WIDE_ROWS:
        raise ValueError(f"wide rows {rows}: linear.c has whole-panel tiles for 0 to {WIDE_ROWS} rows")
    _wide_rows = rows
    for lib in _LINKED:
        lib.batchq_linear_set_wide_rows(rows)


def prefetch_t0() -> bool:
    """Whether linear.c prefetches weights into every cache level (prefetcht0) rather than non-temporally."""
    return _prefetch_t0


def set_prefetch_t0(t0: bool) -> None:
    """linear.c's prefetch hint, in every library with linear.c: prefetcht0 (True) or prefetchnta (False).
    Only when weights arrive depends on it, never an answer. Set before the kernels run."""
    global _prefetch_t0
    _prefetch_t0 = bool(t0)
    for lib in _LINKED:
        lib.batchq_linear_set_prefetch_t0(int(t0))


def has_far_prefetch() -> bool:
    """Whether linear.c, as built here, has the far prefetch (8-float vectors: AVX2 and narrower, whose
    decode steps of every weight type take the K-block tiles that issue it)."""
    lib = library()
    if lib is None:
        return False
    available = int(lib.batchq_linear_set_far_prefetch(1)) == 1
    lib.batchq_linear_set_far_prefetch(int(_far_prefetch))
    return available


def far_prefetch() -> bool:
    """Whether decode-sized steps also prefetch weights far ahead into L2 (`set_far_prefetch`)."""
    return _far_prefetch


def set_far_prefetch(on: bool) -> None:
    """Whether linear.c's decode-sized steps also prefetch each weight line far ahead into L2, beside the
    near prefetch, in every library with linear.c. Only when weights arrive depends on it, never an answer.
    Set before the kernels run."""
    global _far_prefetch
    _far_prefetch = bool(on)
    for lib in _LINKED:
        lib.batchq_linear_set_far_prefetch(int(on))


def has_paced_tiles() -> bool:
    """Whether linear.c, as built here, can pace decode steps of few rows (8-float vectors: AVX2 and
    narrower, whose decode steps of float32 weights take the K-block tiles)."""
    lib = library()
    if lib is None:
        return False
    available = int(lib.batchq_linear_set_pace_rows(PACE_ROWS)) == PACE_ROWS
    lib.batchq_linear_set_pace_rows(_pace_rows)
    return available


def pace_rows() -> int:
    """Decode steps of fewer rows than this run through tiles of this many (`set_pace_rows`; 0: none)."""
    return _pace_rows


def set_pace_rows(rows: int) -> None:
    """Decode-sized steps of fewer than `rows` rows (0: none) run through tiles of `rows` rows whose idle
    rows pace the loop to the weights' arrival (linear.c's pace_rows), in every library with linear.c. The
    answers are the same either way, bit for bit. Set before the kernels run."""
    global _pace_rows
    if rows not in (0, PACE_ROWS):
        raise ValueError(
            f"pace rows {rows}: linear.c paces few-row steps with tiles of {PACE_ROWS} rows, or 0"
        )
    _pace_rows = rows
    for lib in _LINKED:
        lib.batchq_linear_set_pace_rows(rows)


def _setting_speedup(
    setter: str, off: int, on: int, rows: tuple[int, ...], megabytes: int, rounds: int
) -> float:
    """How much faster products of `rows` rows over `megabytes` of float32 weights stream with linear.c's
    setting `setter` (a name of SETTING_SIGNATURES) at `on` than at `off`: the time at off over the time at
    on, each the best of `rounds` interleaved, linear.c's other settings as in force. The weights are more
    than most last-level caches hold, so they come from memory as a model's do (a CPU with a larger L3
    serves part of a small model's from it too). linear.c's settings are restored after."""
    lib = library()
    assert lib is not None
    k, n = 576, 3072  # a small model's MLP: 6.75 MB a weight
    weights = [pack(torch.randn(n, k)) for _ in range(max(1, megabytes * 2**20 // (4 * k * n)))]
    xs = {m: torch.randn(m, k) for m in rows}
    y = torch.empty(max(rows), n)
    threads = torch.get_num_threads()
    set_it = getattr(lib, setter)

    def timed(value: int) -> float:
        set_it(value)
        t0 = time.perf_counter()
        for m, x in xs.items():
            for w in weights:
                lib.batchq_linear(x.data_ptr(), w.data_ptr(), None, None, y.data_ptr(), m, k, n, 0, threads)
        return time.perf_counter() - t0

    try:
        for value in (off, on):
            timed(value)  # warm-up: page faults, the thread pool
        best = {off: float("inf"), on: float("inf")}
        for _ in range(rounds):
            for value in (off, on):
                best[value] = min(best[value], timed(value))
    finally:
        _give_settings(lib)
    return best[off] / best[on]


def measure_wide_tile_speedup(rows: tuple[int, ...] = (1, 3), megabytes: int = 96, rounds: int = 5) -> float:
    """How much faster whole-panel tiles stream decode-sized steps than half-panel ones on this machine
    (`_setting_speedup`), under the prefetch hint in force. 1.0 where linear.c has no such choice."""
    if not has_wide_tiles():
        return 1.0
    return _setting_speedup("batchq_linear_set_wide_rows", 0, WIDE_ROWS, rows, megabytes, rounds)


def measure_prefetch_t0_speedup(
    rows: tuple[int, ...] = (1, 4, 16), megabytes: int = 96, rounds: int = 5
) -> float:
    """How much faster linear.c streams weights prefetching them with prefetcht0 than with prefetchnta on
    this machine (`_setting_speedup`), under the tiling in force."""
    return _setting_speedup("batchq_linear_set_prefetch_t0", 0, 1, rows, megabytes, rounds)


def measure_far_prefetch_speedup(
    rows: tuple[int, ...] = (1, 4, 16), megabytes: int = 96, rounds: int = 5
) -> float:
    """How much faster linear.c streams decode-sized steps' weights with the far prefetch into L2 than
    without it on this machine (`_setting_speedup`), under the hint and tiling in force. 1.0 where linear.c
    has no far prefetch."""
    if not has_far_prefetch():
        return 1.0
    return _setting_speedup("batchq_linear_set_far_prefetch", 0, 1, rows, megabytes, rounds)


def measure_pace_speedup(rows: tuple[int, ...] = (1, 2, 3), megabytes: int = 96, rounds: int = 5) -> float:
    """How much faster decode-sized steps of `rows` rows stream paced (`set_pace_rows`) than not on this
    machine (`_setting_speedup`), under the hint, far prefetch and tiling in force. 1.0 where linear.c
    cannot pace."""
    if not has_paced_tiles():
        return 1.0
    return _setting_speedup("batchq_linear_set_pace_rows", 0, PACE_ROWS, rows, megabytes, rounds)


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


def linear(x: Tensor, weight: Tensor, scale: Tensor | None, bias: Tensor | None, n: int) -> Tensor:
    """y = x W^T (* scale per output) (+ bias). x: [M, K] float32; weight: W [n, K] packed (`pack`);
    scale, bias: [n] float32 or None (scale required for int8). -> [M, n] float32. Called once per
    linear layer per step, so it checks only what is cheap."""
    lib = library()
    assert lib is not None and (scale is not None) == (weight.dtype == torch.int8)
    m, k = x.shape
    assert weight.dim() == 3 and weight.shape[1] == k and weight.shape[0] * PANEL >= n, "pack() the weight"
    x = x.contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    rc = lib.batchq_linear(
        x.data_ptr(), weight.data_ptr(), None if scale is None else scale.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), m, k, n, WEIGHT_TYPES[weight.dtype],
        torch.get_num_threads(),
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
) -> Tensor:
    """y = x W^T (+ bias) for any weight linear.c reads: what `linear` takes, an FP8 E4M3 weight packed
    with a float32 scale per output, or a group-quantised one. x: [M, K] float32 -> [M, n] float32.
    bf16_dot: multiplied in bfloat16, x and the weight rounded (linear_bf16dot.c; `has_bf16dot` only)."""
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
        x.data_ptr(), ctypes.byref(spec), out.data_ptr(), m, k, n, torch.get_num_threads()
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
