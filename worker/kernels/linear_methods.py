"""How a linear layer stores its weight and multiplies by it (vLLM's linear methods): the backend picks one
per layer at load, and the layer's weight lives in that method's layout from then on.

- TorchLinear: F.linear on nn.Linear's [out, in] weight, the op Hugging Face runs (CUDA, bfloat16 compute,
  no C compiler, cpu_kernels = "torch").
- PackedLinear: linear.c on the CPU under float32 activations, the weight packed in panels of 32 outputs
  ([ceil(out / 32), in, 32], native_linear.pack), float32, bfloat16, int8 or FP8 E4M3 (a float32 scale per
  output), widened to float32 as it is read. With bf16_gemm_rows, bfloat16 weights take oneDNN's bf16 GEMM
  for steps of that many rows or more (prompt chunks, on CPUs whose bf16 GEMMs are fast).

Either method also runs weights quantised in groups of input rows (`Groups`: w = s * q - o, 4-bit or 8-bit
q, s and o per group and output; GPTQ, AWQ and GGUF's legacy quants), each in its own layout of q and of
the (s, o) table: TorchLinear dequantises to the activations' dtype per call (correct anywhere, fast
nowhere), linear.c dequantises as it reads, and on a GPU TritonLinear (F.linear for the rest) runs them and
FP8 weights through a Triton GEMM that dequantises tiles in registers (triton_quant.py).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from worker.kernels import native_linear


class Groups(NamedTuple):
    """A group-quantised weight's (s, o) table in its method's layout, and its shape: w = s * q - o per group
    of `group` input rows and output, q of `bits` (4: unsigned, 0..15; 8: signed)."""

    table: Tensor
    group: int
    bits: int


class LinearMethod(Protocol):
    name: str
    layout: str  # what `store` returns: methods of one layout share stored weights
    bf16_gemm_rows: int  # bfloat16 weights: steps of this many rows or more take oneDNN's GEMM (0: never)
    bf16_dot: bool  # bfloat16 weights multiplied in bfloat16 at every row count (linear_bf16dot.c)

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

    def apply(
        self,
        x: Tensor,
        stored: Tensor,
        scale: Tensor | None,
        bias: Tensor | None,
        n: int,
        groups: Groups | None = None,
    ) -> Tensor:
        """y = x W^T (* scale per output) (+ bias): x [T, in] -> [T, n]. With groups, `stored` is q."""
        ...

    def store_q(self, q: Tensor, bits: int) -> Tensor:
        """A group-quantised weight's q [out, in] (uint8 0..15 for 4 bits, int8 for 8) -> this layout."""
        ...

    def unpack_q(self, stored: Tensor, n: int, bits: int) -> Tensor:
        """store_q's inverse: -> [n, in]."""
        ...

    def store_groups(self, s: Tensor, o: Tensor) -> Tensor:
        """A group-quantised weight's s, o [out, groups] -> this layout's table."""
        ...

    def rows_q(self, stored: Tensor, ids: Tensor, bits: int) -> Tensor:
        """Rows `ids` of a group-quantised weight's q [out, in]: [T] -> [T, in]."""
        ...

    def rows_groups(self, table: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Rows `ids` of s and o [out, groups]: [T] -> 2 x [T, groups]."""
        ...

    def unpack_groups(self, table: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """store_groups' inverse: -> s, o [n, groups]."""
        ...


class TorchLinear:
    name = "torch"
    layout = "[out, in]"
    bf16_gemm_rows = 0
    bf16_dot = False

    def takes(self, weight: Tensor) -> bool:
        return True

    def store(self, weight: Tensor) -> Tensor:
        return weight

    def unpack(self, stored: Tensor, n: int) -> Tensor:
        return stored

    def rows(self, stored: Tensor, ids: Tensor) -> Tensor:
        return F.embedding(ids, stored)

    def apply(
        self,
        x: Tensor,
        stored: Tensor,
        scale: Tensor | None,
        bias: Tensor | None,
        n: int,
        groups: Groups | None = None,
    ) -> Tensor:
        if groups is not None:
            s, o = self.unpack_groups(groups.table, n)
            return F.linear(x, dequantized_groups(stored, s, o, groups.group).to(x.dtype), bias)
        return F.linear(x, dequantized(stored, scale, x.dtype), bias)

    def store_q(self, q: Tensor, bits: int) -> Tensor:
        return q

    def unpack_q(self, stored: Tensor, n: int, bits: int) -> Tensor:
        return stored

    def store_groups(self, s: Tensor, o: Tensor) -> Tensor:
        return torch.stack((s, o), dim=-1)  # [out, groups, 2]

    def unpack_groups(self, table: Tensor, n: int) -> tuple[Tensor, Tensor]:
        return table[..., 0], table[..., 1]

    def rows_q(self, stored: Tensor, ids: Tensor, bits: int) -> Tensor:
        return stored[ids]

    def rows_groups(self, table: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        return table[ids, :, 0], table[ids, :, 1]


TORCH_LINEAR = TorchLinear()


def dequantized(weight: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """An [out, in] weight in `dtype`, times its scale per output row where it has one (int8, FP8)."""
    if scale is not None:
        return (weight.float() * scale[:, None]).to(dtype)
    return weight if weight.dtype == dtype else weight.to(dtype)


def dequantized_groups(q: Tensor, s: Tensor, o: Tensor, group: int) -> Tensor:
    """The float32 [out, in] weight s * q - o of a group-quantised one (q [out, in], s and o [out, in /
    group]): the reference formula, each weight rounded once in float32 as linear.c computes it."""
    n, k = q.shape
    qg = q.float().view(n, k // group, group)
    return torch.addcmul(-o.float()[..., None], qg, s.float()[..., None]).view(n, k)


class PackedLinear:
    name = "c"
    layout = "packed"

    def __init__(
        self,
        bf16_gemm_rows: int,
        bf16_dot: bool = False,
        tuning: native_linear.LinearTuning = native_linear.DEFAULT_TUNING,
    ) -> None:
        self.bf16_gemm_rows = bf16_gemm_rows  # 0: never
        # bfloat16, int8, FP8 and group-quantised weights multiplied in bfloat16 at every row count
        # (linear_bf16dot.c): the batch-invariant bfloat16 engine's, on a CPU with AVX-512 BF16
        self.bf16_dot = bf16_dot
        self.tuning = tuning  # linear.c's for this machine (no answer depends on it)

    def takes(self, weight: Tensor) -> bool:
        return weight.device.type == "cpu" and (
            weight.dtype in native_linear.WEIGHT_TYPES or weight.dtype in (torch.float8_e4m3fn, torch.uint8)
        )

    def store(self, weight: Tensor) -> Tensor:
        return native_linear.pack(weight)

    def unpack(self, stored: Tensor, n: int) -> Tensor:
        return native_linear.unpack(stored, n)

    def rows(self, stored: Tensor, ids: Tensor) -> Tensor:
        return native_linear.packed_rows(stored, ids)

    def store_q(self, q: Tensor, bits: int) -> Tensor:
        return native_linear.pack_q4(q) if bits == 4 else native_linear.pack(q)

    def unpack_q(self, stored: Tensor, n: int, bits: int) -> Tensor:
        return native_linear.unpack_q4(stored, n) if bits == 4 else native_linear.unpack(stored, n)

    def store_groups(self, s: Tensor, o: Tensor) -> Tensor:
        return native_linear.pack_groups(s, o, s.dtype)

    def unpack_groups(self, table: Tensor, n: int) -> tuple[Tensor, Tensor]:
        return native_linear.unpack_groups(table, n)

    def rows_q(self, stored: Tensor, ids: Tensor, bits: int) -> Tensor:
        return (
            native_linear.packed_q4_rows(stored, ids) if bits == 4 else native_linear.packed_rows(stored, ids)
        )

    def rows_groups(self, table: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        return native_linear.packed_group_rows(table, ids)

    def apply(
        self,
        x: Tensor,
        stored: Tensor,
        scale: Tensor | None,
        bias: Tensor | None,
        n: int,
        groups: Groups | None = None,
    ) -> Tensor:
        if groups is not None:
            if x.dtype != torch.float32:
                s, o = self.unpack_groups(groups.table, n)
                q = self.unpack_q(stored, n, groups.bits)
                return TORCH_LINEAR.apply(
                    x, q, None, bias, n, Groups(TORCH_LINEAR.store_groups(s, o), *groups[1:])
                )
            gq = native_linear.GroupQuantized(stored, groups.table, groups.group, groups.bits)
            return native_linear.linear_w(x, gq, n, bias=bias, bf16_dot=self.bf16_dot, tuning=self.tuning)
        if x.dtype != torch.float32:  # linear.c takes float32 activations only
            return TORCH_LINEAR.apply(x, self.unpack(stored, n), scale, bias, n)
        if stored.dtype == torch.float8_e4m3fn or (self.bf16_dot and stored.dtype != torch.float32):
            return native_linear.linear_w(
                x, stored, n, scale=scale, bias=bias, bf16_dot=self.bf16_dot, tuning=self.tuning
            )
        if self.bf16_gemm_rows and stored.dtype == torch.bfloat16 and x.shape[0] >= self.bf16_gemm_rows:
            # Prompt-sized steps on a CPU with fast bf16 GEMMs (oneDNN): bf16 activations, float32 out. The
            # [out, in] copy of the weight is a small part of such a GEMM.
            return F.linear(
                x.bfloat16(), self.unpack(stored, n), None if bias is None else bias.bfloat16()
            ).float()
        return native_linear.linear(x, stored, scale, bias, n, self.tuning)


class TritonLinear(TorchLinear):
    """F.linear for every weight but those kept quantised (groups, FP8), which triton_quant's GEMM runs
    from a layout of its own: 4-bit q packed two to a byte along K; the (s, o) table [out, groups, 2] and
    every unquantised weight are kept as TorchLinear keeps them."""

    name = "triton"
    layout = "triton"

    def __init__(self, invariant: bool = False) -> None:
        # invariant: unquantised weights through triton_invariant's fixed-tile GEMM instead of cuBLAS, which
        # picks its kernel by the step's row count (a row's bits would follow its neighbours); quantised ones
        # through triton_quant with one row tile at every row count
        self.invariant = invariant

    def store_q(self, q: Tensor, bits: int) -> Tensor:
        from worker.kernels import triton_quant

        return triton_quant.pack_q4_rows(q) if bits == 4 else q

    def unpack_q(self, stored: Tensor, n: int, bits: int) -> Tensor:
        from worker.kernels import triton_quant

        return triton_quant.unpack_q4_rows(stored) if bits == 4 else stored

    def rows_q(self, stored: Tensor, ids: Tensor, bits: int) -> Tensor:
        return self.unpack_q(stored[ids], ids.shape[0], bits)

    def apply(
        self,
        x: Tensor,
        stored: Tensor,
        scale: Tensor | None,
        bias: Tensor | None,
        n: int,
        groups: Groups | None = None,
    ) -> Tensor:
        if groups is None and stored.dtype != torch.float8_e4m3fn:
            if not self.invariant or scale is not None:
                return TORCH_LINEAR.apply(x, stored, scale, bias, n)
            from worker.kernels import triton_invariant

            w = stored if stored.dtype == x.dtype else stored.to(x.dtype)
            return triton_invariant.matmul(x, w, None if bias is None else bias.to(x.dtype))
        from worker.kernels import triton_quant

        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if groups is not None:
            y = triton_quant.quant_linear(
                x2, stored, n, groups.table, groups.group, groups.bits, bias=bias, invariant=self.invariant
            )
        else:
            y = triton_quant.quant_linear(x2, stored, n, scale=scale, bias=bias, invariant=self.invariant)
        return y.view(*lead, n)
