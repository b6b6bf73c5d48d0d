"""Building blocks shared by the decoder: RMSNorm, rotary embedding table, per-step attention metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worker.kernels import native


class Linear(nn.Module):
    """y = x W^T (+ bias), W [out, in] as in nn.Linear and Hugging Face checkpoints.

    On the CPU, with float32 activations, the C kernel of native.py (linear.c) runs every call where it
    builds (`use_native`): the weight is then stored packed in linear.c's panels of 32 output columns
    ([ceil(out / 32), in, 32]), each streamed once per call, with the register-tiled outer product of GEMM
    kernels. MKL's sgemm, at decode sizes, ran at a third of the memory bandwidth or less on AMD EPYCs
    (issue #21), and at prompt sizes ~2.5x slower than linear.c there (`python benchmarks/kernel_bench.py
    --linear` prints both). Elsewhere (CUDA, bfloat16 compute, no C compiler) F.linear runs on the
    [out, in] weight, the very op Hugging Face runs.

    `quantize` may store the weight narrower for the C kernel, which widens it to float32 as it reads:
    bfloat16 (half the bytes) or int8 with a float32 scale per output (a quarter). Both change outputs
    slightly, so neither is a default.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # packed when self.native
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.scale: Tensor | None
        self.register_buffer("scale", None)  # [out] float32: int8 weights only
        self.native = False  # set by use_native(): linear.c on CPU float32 activations, weight packed
        # bfloat16 weights: steps of at least this many rows run oneDNN's bf16 GEMM instead (0: never); set
        # at load where bf16 GEMMs are much faster than float32 ones (device.cpu_auto_dtype's probe)
        self.bf16_gemm_rows = 0

    @torch.no_grad()
    def use_native(self, on: bool = True) -> None:
        """Run linear.c (on float32 activations) where it takes this weight, packing the weight for it;
        off: back to the [out, in] weight and F.linear."""
        if on and not self.native and native.weight_supported(self.weight):
            self.weight = nn.Parameter(native.pack(self.weight.detach()), requires_grad=False)
            self.native = True
        elif not on and self.native:
            self.weight = nn.Parameter(self.unpacked(), requires_grad=False)
            self.native = False

    def unpacked(self) -> Tensor:
        """The weight [out, in] as stored (a copy where it is packed)."""
        return native.unpack(self.weight, self.out_features) if self.native else self.weight

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, in] -> [T, out]
        if self.native and x.dtype == torch.float32:
            if (
                self.bf16_gemm_rows
                and self.weight.dtype == torch.bfloat16
                and x.shape[0] >= self.bf16_gemm_rows
            ):
                # Prompt-sized steps on a CPU with fast bf16 GEMMs (oneDNN): bf16 activations, float32 out.
                # The [out, in] copy of the weight costs ~15% of such a GEMM at 512 rows.
                return F.linear(
                    x.bfloat16(), self.unpacked(), None if self.bias is None else self.bias.bfloat16()
                ).float()
            return native.linear(x, self.weight, self.scale, self.bias, self.out_features)
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """The weight [out, in] in `dtype` (itself where it is stored so, unpacked)."""
        w = self.unpacked()
        if self.scale is not None:
            return (w.float() * self.scale[:, None]).to(dtype)
        return w if w.dtype == dtype else w.to(dtype)

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows `ids` of the weight in `dtype`: a tied embedding's lookup. ids: [T] -> [T, in]."""
        w = native.packed_rows(self.weight, ids) if self.native else F.embedding(ids, self.weight)
        if self.scale is not None:
            return (w.float() * self.scale[ids, None]).to(dtype)
        return w.to(dtype)

    @torch.no_grad()
    def load(self, weight: Tensor, bias: Tensor | None = None) -> None:
        """Copy a Hugging Face weight [out, in] (and bias [out])."""
        self.weight.copy_(native.pack(weight) if self.native else weight)
        if self.bias is not None:
            assert bias is not None, "a biased layer needs its bias"
            self.bias.copy_(bias)

    @torch.no_grad()
    def quantize(self, dtype: torch.dtype) -> None:
        """Store the weight as bfloat16, or as int8 with a symmetric scale per output row."""
        packed = self.native
        self.use_native(False)
        w = self.weight.detach().float()
        if dtype == torch.int8:
            scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
            self.weight = nn.Parameter((w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), False)
            self.scale = scale.contiguous()
        else:
            self.weight = nn.Parameter(w.to(dtype), requires_grad=False)
            self.scale = None
        self.use_native(packed)


class RMSNorm(nn.Module):
    """HF-exact RMSNorm: statistics in float32, weight applied after casting back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.native = False  # linear.c's batchq_rmsnorm for float32 rows on the CPU (set at load)

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., dim] -> [..., dim]
        if self.native and x.dtype == torch.float32:  # rows of any shape (Qwen3's per-head norms: 3-D)
            return native.rmsnorm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class RotaryTable(nn.Module):
    """cos/sin for every position up to max_len, from HF's inv_freq and attention scaling (any rope type)."""

    def __init__(self, inv_freq: Tensor, attention_scaling: float, max_len: int) -> None:
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.float()[None, :]  # [max_len, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = nn.Buffer(emb.cos() * attention_scaling, persistent=False)  # [max_len, head_dim]
        self.sin = nn.Buffer(emb.sin() * attention_scaling, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # positions: [T] -> cos, sin: [T, 1, head_dim]
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, in_place: bool = False) -> Tensor:
    # x: [T, heads, head_dim]; cos, sin: [T, 1, head_dim]. in_place: float32 on the CPU, rotated by
    # linear.c's batchq_rotary in x's own memory (x may be a view into the fused QKV output).
    if in_place:
        native.rotary_(x, cos.squeeze(1), sin.squeeze(1))
        return x
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the paged cache. Passed explicitly, never a global."""

    phase: Literal["prefill", "decode", "mixed"]
    slot_mapping: Tensor  # [T] int64: cache slot of each new token
    block_tables: Tensor  # [batch, max_blocks] int32
    context_lens: Tensor  # [batch] int32: tokens in the cache per sequence, this step's included
    cu_seqlens_q: Tensor | None = None  # [batch + 1] int32, prefill (and the prompt chunks of mixed) only
    # "mixed": the first decode.context_lens.shape[0] tokens decode (described by `decode`); the rest are
    # prompt chunks, described by the fields above (slot_mapping covers every token).
    decode: AttentionMetadata | None = None
