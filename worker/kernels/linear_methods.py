"""How a linear layer stores its weight and multiplies by it (vLLM's linear methods): the backend picks one
per layer at load, and the layer's weight lives in that method's layout from then on.

- TorchLinear: F.linear on nn.Linear's [out, in] weight, the op Hugging Face runs (CUDA, bfloat16 compute,
  no C compiler, cpu_kernels = "torch").
- PackedLinear: linear.c on the CPU under float32 activations, the weight packed in panels of 32 outputs
  ([ceil(out / 32), in, 32], native_linear.pack), float32, bfloat16 or int8 (a float32 scale per output),
  widened to float32 as it is read. With bf16_gemm_rows, bfloat16 weights take oneDNN's bf16 GEMM for
  steps of that many rows or more (prompt chunks, on CPUs whose bf16 GEMMs are fast).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from worker.kernels import native_linear


class LinearMethod(Protocol):
    name: str
    layout: str  # what `store` returns: methods of one layout share stored weights
    bf16_gemm_rows: int  # bfloat16 weights: steps of this many rows or more take oneDNN's GEMM (0: never)

    def takes(self, weight: Tensor) -> bool:
        """Whether this method runs a weight of this dtype on this device."""
        ...

    def store(self, weight: Tensor) -> Tensor:
        """nn.Linear's [out, in] weight -> this method's layout."""
        ...

    def unpack(self, stored: Tensor, n: int) -> Tensor:
        """store's inverse: -> [n, in] (`stored` itself where it is that already)."""
        ...

    def rows(self, stored: Tensor, ids: Tensor) -> Tensor:
        """Rows `ids` of the [out, in] weight: [T] -> [T, in] (a tied embedding's lookup)."""
        ...

    def apply(self, x: Tensor, stored: Tensor, scale: Tensor | None, bias: Tensor | None, n: int) -> Tensor:
        """y = x W^T (* scale per output) (+ bias): x [T, in] -> [T, n]."""
        ...


class TorchLinear:
    name = "torch"
    layout = "[out, in]"
    bf16_gemm_rows = 0

    def takes(self, weight: Tensor) -> bool:
        return True

    def store(self, weight: Tensor) -> Tensor:
        return weight

    def unpack(self, stored: Tensor, n: int) -> Tensor:
        return stored

    def rows(self, stored: Tensor, ids: Tensor) -> Tensor:
        return F.embedding(ids, stored)

    def apply(self, x: Tensor, stored: Tensor, scale: Tensor | None, bias: Tensor | None, n: int) -> Tensor:
        return F.linear(x, dequantized(stored, scale, x.dtype), bias)


TORCH_LINEAR = TorchLinear()


def dequantized(weight: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """An [out, in] weight in `dtype`, times its scale per output row where it has one (int8)."""
    if scale is not None:
        return (weight.float() * scale[:, None]).to(dtype)
    return weight if weight.dtype == dtype else weight.to(dtype)


class PackedLinear:
    name = "c"
    layout = "packed"

    def __init__(self, bf16_gemm_rows: int) -> None:
        self.bf16_gemm_rows = bf16_gemm_rows  # 0: never

    def takes(self, weight: Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype in native_linear.WEIGHT_TYPES

    def store(self, weight: Tensor) -> Tensor:
        return native_linear.pack(weight)

    def unpack(self, stored: Tensor, n: int) -> Tensor:
        return native_linear.unpack(stored, n)

    def rows(self, stored: Tensor, ids: Tensor) -> Tensor:
        return native_linear.packed_rows(stored, ids)

    def apply(self, x: Tensor, stored: Tensor, scale: Tensor | None, bias: Tensor | None, n: int) -> Tensor:
        if x.dtype != torch.float32:  # linear.c takes float32 activations only
            return TORCH_LINEAR.apply(x, self.unpack(stored, n), scale, bias, n)
        if self.bf16_gemm_rows and stored.dtype == torch.bfloat16 and x.shape[0] >= self.bf16_gemm_rows:
            # Prompt-sized steps on a CPU with fast bf16 GEMMs (oneDNN): bf16 activations, float32 out. The
            # [out, in] copy of the weight is a small part of such a GEMM.
            return F.linear(
                x.bfloat16(), self.unpack(stored, n), None if bias is None else bias.bfloat16()
            ).float()
        return native_linear.linear(x, stored, scale, bias, n)
