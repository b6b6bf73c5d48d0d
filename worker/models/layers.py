"""Building blocks shared by the decoders: RMSNorm, rotary embedding table, per-step attention metadata, and
attention over the paged cache through the backend (`paged_attention`, which the transformers fallback
runs too)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor, nn

from worker.kernels.backend import (
    TORCH_LINEAR,
    Backend,
    Groups,
    LinearMethod,
    dequantized,
    dequantized_groups,
)


class Adapters(Protocol):
    """A linear's LoRA adapters (models/lora.py LoraLayer): each row's adapter's delta added to its output."""

    def add(self, x: Tensor, y: Tensor) -> Tensor: ...


KVCache = tuple[Tensor, Tensor]  # one layer's k, v in the attention backend's layout (backend.kv_cache_shape)


class Linear(nn.Module):
    """y = x W^T (+ bias), W [out, in] as in nn.Linear and Hugging Face checkpoints.

    The weight is stored in the layout of the layer's method (`method`, linear_methods.py), chosen once at
    load by the backend (`use_method`): nn.Linear's [out, in] for F.linear, the very op Hugging Face runs;
    on a CPU under float32 compute, linear.c's packed panels of 32 outputs ([ceil(out / 32), in, 32]), each
    streamed once per call with the register-tiled outer product of GEMM kernels, where MKL's sgemm runs far
    below memory bandwidth at decode sizes (`python benchmarks/kernel_bench.py --linear` compares them).
    `unpacked()` is the [out, in] weight whatever the layout.

    `quantize` may store the weight narrower for the C kernel, which widens it to float32 as it reads:
    bfloat16 (half the bytes) or int8 with a float32 scale per output (a quarter). Both change outputs
    slightly, so neither is a default. A checkpoint's own quantisation is kept as it ships: FP8 E4M3 with a
    scale per output (`load` of a float8 weight), or groups of input rows (`load_groups`: w = s * q - o,
    4-bit or 8-bit q; GPTQ, AWQ, GGUF), in the method's layout of q (`weight`) and of (s, o) (`group_table`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # in self.method's layout
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.scale: Tensor | None
        self.register_buffer("scale", None)  # [out] float32: int8 and FP8 weights only
        self.group_table: Tensor | None
        self.register_buffer("group_table", None)  # group-quantised weights: (s, o) in the method's layout
        self.group = self.bits = 0  # rows of K per group, bits of q (0: not group-quantised)
        self.in_perm: Tensor | None
        self.register_buffer("in_perm", None)  # [in] int64: the input order q's rows follow (GPTQ act-order)
        self.method: LinearMethod = TORCH_LINEAR
        self.lora: Adapters | None = None  # its adapters' slots, where LoRA adapters are served

    @torch.no_grad()
    def use_method(self, method: LinearMethod) -> None:
        """Run `method`, the weight moved into its layout (the backend's choice, made once at load)."""
        if method.layout != self.method.layout:
            if self.bits:
                s, o = self.group_s_o()
                self.group_table = method.store_groups(s, o)
                self.weight = nn.Parameter(method.store_q(self.unpacked(), self.bits), requires_grad=False)
            else:
                self.weight = nn.Parameter(method.store(self.unpacked()), requires_grad=False)
        self.method = method

    def unpacked(self) -> Tensor:
        """The weight [out, in] as stored (a copy where its layout is another); q of a group-quantised one."""
        if self.bits:
            return self.method.unpack_q(self.weight, self.out_features, self.bits)
        return self.method.unpack(self.weight, self.out_features)

    def group_s_o(self) -> tuple[Tensor, Tensor]:
        """A group-quantised weight's s, o [out, in / group]."""
        assert self.group_table is not None
        return self.method.unpack_groups(self.group_table, self.out_features)

    def groups(self) -> Groups | None:
        return None if self.group_table is None else Groups(self.group_table, self.group, self.bits)

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, in] -> [T, out]
        if self.bits:
            xq = x if self.in_perm is None else x.index_select(1, self.in_perm)
            y = self.method.apply(xq, self.weight, None, self.bias, self.out_features, self.groups())
        else:
            y = self.method.apply(x, self.weight, self.scale, self.bias, self.out_features)
        return y if self.lora is None else self.lora.add(x, y)

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """The weight [out, in] in `dtype` (itself where it is stored so, unpacked)."""
        if self.bits:
            w = dequantized_groups(self.unpacked(), *self.group_s_o(), self.group)
            if self.in_perm is not None:  # back to the layer's own input order
                w = w[:, torch.argsort(self.in_perm)]
            return w.to(dtype)
        return dequantized(self.unpacked(), self.scale, dtype)

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows `ids` of the weight in `dtype`: a tied embedding's lookup. ids: [T] -> [T, in]."""
        if self.bits:  # a quantised tied embedding (GGUF's): only the rows asked for are dequantised
            assert self.group_table is not None and self.in_perm is None
            q = self.method.rows_q(self.weight, ids, self.bits)
            s, o = self.method.rows_groups(self.group_table, ids)
            return dequantized_groups(q, s, o, self.group).to(dtype)
        w = self.method.rows(self.weight, ids)
        if self.scale is not None:
            return (w.float() * self.scale[ids, None]).to(dtype)
        return w.to(dtype)

    @torch.no_grad()
    def load(self, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> None:
        """Copy a Hugging Face weight [out, in] (and bias [out]); an FP8 E4M3 weight keeps its dtype, with its
        float32 scale per output (`scale`)."""
        if weight.dtype == torch.float8_e4m3fn:
            assert scale is not None and scale.shape == (self.out_features,), "an FP8 weight needs its scales"
            self.weight = nn.Parameter(self.method.store(weight), requires_grad=False)
            self.scale = scale.float().contiguous()
        else:
            self.weight.copy_(self.method.store(weight))
        if self.bias is not None:
            assert bias is not None, "a biased layer needs its bias"
            self.bias.copy_(bias)

    def empty_groups(
        self, group: int, bits: int, act_order: bool, table_dtype: torch.dtype = torch.float32
    ) -> None:
        """Room for a group-quantised weight (torch's layout, before the backend's), filled by load_weights:
        q in `weight`, (s, o) in `group_table` (of table_dtype), act-order's input order in `in_perm`."""
        n, k, device = self.out_features, self.in_features, self.weight.device
        if k % group:
            raise ValueError(f"{k} input rows do not split into groups of {group}")
        dtype = torch.uint8 if bits == 4 else torch.int8
        self.weight = nn.Parameter(torch.empty(n, k, dtype=dtype, device=device), requires_grad=False)
        self.group_table = torch.empty(n, k // group, 2, dtype=table_dtype, device=device)
        self.in_perm = torch.empty(k, dtype=torch.int64, device=device) if act_order else None
        self.group, self.bits, self.scale = group, bits, None

    @torch.no_grad()
    def dequantize(self, dtype: torch.dtype) -> None:
        """Store the weight dense in `dtype` (its reference dequantisation), in the method's layout."""
        w = self.dequantized(dtype)
        self.weight = nn.Parameter(self.method.store(w), requires_grad=False)
        self.group_table = self.in_perm = self.scale = None
        self.group = self.bits = 0

    def empty_fp8(self) -> None:
        """Room for an FP8 E4M3 weight and its float32 scale per output, filled by load_weights."""
        device = self.weight.device
        shape = (self.out_features, self.in_features)
        self.weight = nn.Parameter(
            torch.empty(shape, dtype=torch.float8_e4m3fn, device=device), requires_grad=False
        )
        self.scale = torch.empty(self.out_features, device=device)

    @torch.no_grad()
    def load_groups(
        self, q: Tensor, s: Tensor, o: Tensor, group: int, bits: int, perm: Tensor | None = None
    ) -> None:
        """Keep a group-quantised weight as it ships: w = s * q - o, q [out, in] (uint8 0..15 for 4 bits,
        int8 for 8), s and o [out, in / group] (float32 or float16); perm: q's input order (column k' of q
        multiplies input perm[k']), or None for the layer's own."""
        n, k = self.out_features, self.in_features
        if q.shape != (n, k) or s.shape != (n, k // group) or o.shape != s.shape or k % group:
            raise ValueError(
                f"group-quantised weight: q {tuple(q.shape)}, s {tuple(s.shape)}, o {tuple(o.shape)} do not "
                f"make a [{n}, {k}] weight in groups of {group}"
            )
        self.weight = nn.Parameter(self.method.store_q(q, bits), requires_grad=False)
        self.group_table = self.method.store_groups(s, o)
        self.group, self.bits, self.scale = group, bits, None
        self.in_perm = None if perm is None else perm.long().contiguous()

    @torch.no_grad()
    def quantize(self, dtype: torch.dtype) -> None:
        """Store the weight as bfloat16, or as int8 with a symmetric scale per output row (in its layout)."""
        w = self.unpacked().float()
        if dtype == torch.int8:
            scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
            w = (w / scale[:, None]).round().clamp(-127, 127)
            self.scale = scale.contiguous()
        else:
            self.scale = None
        self.weight = nn.Parameter(self.method.store(w.to(dtype)), requires_grad=False)


class RMSNorm(nn.Module):
    """HF-exact RMSNorm: statistics in float32, weight applied after casting back.

    plus_one (Gemma 2 / 3): the weight is stored as the checkpoint holds it, w, and the norm scales by 1 + w
    computed in float32, before the cast back, as Hugging Face's Gemma norms do (a bfloat16 1 + w would
    round, and so would a bfloat16 product)."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))
        self.eps = eps
        self.plus_one = plus_one
        self.c_rows: Callable[[Tensor, Tensor, float], Tensor] | None = (
            None  # the backend's (float32), at load
        )
        # the backend's RMSNorm of rows in any dtype (Triton's batch-invariant kernel on CUDA), at load
        self.norm_rows: Callable[..., Tensor] | None = None

    def scale(self) -> Tensor:
        """What the normalised rows are multiplied by: the weight, or 1 + w in float32 (plus_one)."""
        return 1.0 + self.weight.float() if self.plus_one else self.weight

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., dim] -> [..., dim]
        if self.c_rows is not None and x.dtype == torch.float32:  # any rows (Qwen3's per-head norms: 3-D)
            return self.c_rows(x.reshape(-1, x.shape[-1]), self.scale(), self.eps).view(x.shape)
        if self.norm_rows is not None:  # the raw weight: the kernel adds Gemma's 1 in float32
            return self.norm_rows(x, self.weight, self.eps, offset=1.0 if self.plus_one else 0.0)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (xf * self.scale()).to(dtype)
        return self.weight * xf.to(dtype)


class RotaryTable(nn.Module):
    """cos/sin for every position up to max_len, from HF's inv_freq and attention scaling (any rope type).

    long: LongRoPE's (inv_freq of the long factors, first position they rotate); the positions before it
    take `inv_freq`, the short factors (loader._long_rope says why per position).
    A partial rotary factor shows as an inv_freq of fewer than head_dim / 2 frequencies: the table's rows are
    then narrower than a head (`dim`), and only a head's first `dim` values rotate.
    """

    def __init__(
        self,
        inv_freq: Tensor,
        attention_scaling: float,
        max_len: int,
        long: tuple[Tensor, int] | None = None,
        mrope_section: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.float()[None, :]  # [max_len, head_dim / 2]
        if long is not None:
            long_inv_freq, start = long
            freqs[start:] = pos[start:, None] * long_inv_freq.float().to(freqs.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.dim = emb.shape[1]
        self.cos = nn.Buffer(emb.cos() * attention_scaling, persistent=False)  # [max_len, dim]
        self.sin = nn.Buffer(emb.sin() * attention_scaling, persistent=False)
        # M-RoPE: which of a token's (temporal, height, width) positions each column rotates by: the
        # frequencies in mrope_section's runs, the runs taking the three in turn (Hugging Face's
        # recomposition), the same for both halves
        self.component: Tensor | None
        component = None
        if mrope_section is not None:
            half = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(mrope_section)])
            assert half.numel() == self.dim // 2, "mrope_section must cover the rotary frequencies"
            component = torch.cat((half, half))
        self.register_buffer("component", component, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # positions: [T], or [3, T] under M-RoPE (each token's temporal, height, width) -> cos, sin:
        # [T, 1, head_dim]
        if positions.dim() == 2:
            assert self.component is not None, "three positions per token need M-RoPE's sections"
            rows = positions[self.component].t().contiguous()  # [T, dim]: each column's position
            cols = torch.arange(self.dim, device=positions.device)
            return self.cos[rows, cols].to(dtype).unsqueeze(1), self.sin[rows, cols].to(dtype).unsqueeze(1)
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(
    x: Tensor, cos: Tensor, sin: Tensor, in_place: Callable[[Tensor, Tensor, Tensor], None] | None = None
) -> Tensor:
    # x: [T, heads, head_dim]; cos, sin: [T, 1, dim], dim < head_dim under a partial rotary factor (only a
    # head's first dim values rotate). in_place: the backend's rotary in C (float32 on the CPU), which rotates
    # x in its own memory (x may be a view into the fused QKV output).
    dim = cos.shape[-1]
    partial = dim < x.shape[-1]
    if in_place is not None:
        in_place(x[..., :dim] if partial else x, cos.squeeze(1), sin.squeeze(1))
        return x
    if partial:
        return torch.cat((apply_rotary(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
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


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv: KVCache,
    meta: AttentionMetadata,
    backend: Backend,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Write this step's K/V into one layer's paged cache, then attend over each sequence's cached context.

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] (rotated) -> [T, heads, head_dim]. The cache
    holds K / k_scale and V / v_scale (an FP8 cache's calibrated scales; 1 otherwise): q.k/s_k scores with
    the softmax scale times s_k, and the output is multiplied by s_v, so the kernels never see a scale.
    window: the layer's sliding window, keys a query sees with its own (None: all); softcap: its
    attention-logit soft-capping, scores = softcap * tanh(scores / softcap) (None: none); sinks: [heads],
    a logit per head in every softmax's denominator (gpt-oss), or None (then not passed: a backend sees the
    keyword only where a model has sinks).
    """
    variant: dict[str, object] = {"window": window, "softcap": softcap}
    if sinks is not None:
        variant["sinks"] = sinks
    if k_scale != 1.0 or v_scale != 1.0:
        k, v, scale = k / k_scale, v / v_scale, scale * k_scale
    k_cache, v_cache = kv
    attn = backend.attention
    attn.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.phase == "decode":
        o = attn.paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, **variant
        )
    elif meta.phase == "prefill":
        assert meta.cu_seqlens_q is not None
        o = attn.paged_prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, scale, k=k, v=v,
            **variant,
        )  # fmt: skip
    else:  # mixed: decode rows first, then prompt chunks, each through its own kernel
        assert meta.cu_seqlens_q is not None and meta.decode is not None
        nd = meta.decode.context_lens.shape[0]
        od = attn.paged_decode_attention(
            q[:nd], k_cache, v_cache, meta.decode.block_tables, meta.decode.context_lens, scale, **variant
        )
        op = attn.paged_prefill_attention(
            q[nd:], k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, scale,
            k=k[nd:], v=v[nd:], **variant,
        )  # fmt: skip
        o = torch.cat([od, op])
    return o if v_scale == 1.0 else o * v_scale
