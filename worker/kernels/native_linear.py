"""The linear layers in C (linear.c) and their packed weight layout; RMSNorm and rotary rows beside them.

y = x W^T + b, W nn.Linear's [out, in] weight stored packed in panels of PANEL outputs (`pack`), float32,
bfloat16 or int8 with a scale per output row: each panel is streamed once per call and multiplied with
every row of x from registers, where MKL's sgemm runs far below memory bandwidth at decode sizes
(`python benchmarks/kernel_bench.py --linear` compares them).
"""

from __future__ import annotations

import time
from ctypes import c_float, c_int, c_long, c_void_p
from types import SimpleNamespace

import torch
from torch import Tensor

from worker.kernels.native_build import KERNELS, Signature, cached, load

SOURCES = (KERNELS / "linear.c",)
SIGNATURES = {
    "batchq_linear": Signature(c_int, [c_void_p] * 5 + [c_int] * 5),
    "batchq_rmsnorm": Signature(None, [c_void_p] * 3 + [c_int] * 2 + [c_float]),
    "batchq_rotary": Signature(None, [c_void_p, c_int, c_int, c_long, c_long, c_void_p, c_void_p, c_int]),
    "batchq_fma_probe": Signature(c_int, [c_long, c_int, c_void_p]),
}
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # linear.c's `elem`
PANEL = 32  # linear.c's PANEL: output columns per panel of a packed weight


@cached
def library() -> SimpleNamespace | None:
    """The loaded linear kernel (linear.c), or None (with one warning) where it cannot be built."""
    return load(SOURCES, "the linear layers", SIGNATURES)


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


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Hugging Face's RMSNorm of float32 rows x [T, D] (contiguous) with a float32 weight [D]."""
    lib = library()
    assert lib is not None and x.dtype == torch.float32 and weight.dtype == torch.float32
    x = x.contiguous()
    out = torch.empty_like(x)
    t, d = x.shape
    lib.batchq_rmsnorm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), t, d, eps)
    return out


def rotary_(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Rotate float32 x [T, H, D] in place (any row and head strides, unit stride within a head) by the
    contiguous float32 rows cos, sin [T, D]: Hugging Face's rotate-half rotary embedding."""
    lib = library()
    assert lib is not None and x.dtype == cos.dtype == sin.dtype == torch.float32 and x.stride(2) == 1
    assert cos.is_contiguous() and sin.is_contiguous()
    t, h, d = x.shape
    lib.batchq_rotary(x.data_ptr(), t, h, x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), d)
