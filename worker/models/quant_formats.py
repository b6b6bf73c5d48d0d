"""Quantised checkpoints' weight formats (GPTQ, AWQ, compressed-tensors FP8) in batchq's terms, without
dequantising: a GPTQ or AWQ linear becomes q [out, in] with s, o per group of input rows (w = s * q - o), an
FP8 one stays FP8 with a float32 scale per output.

The published formulas, each exact in float32 as batchq computes it (s * q - o, rounded once):
- GPTQ: w[k, n] = scales[g, n] * (q[k, n] - z[g, n]), g = g_idx[k]; q packed 8 to an int32 along k
  (qweight [in / 8, out]), z along n (qzeros [groups, out / 8]), stored as z - 1 in the original
  checkpoint format ("gptq"), as z in "gptq_v2". With act-order (desc_act) g_idx is not k // group: the
  input rows are reordered so that each group's rows are contiguous (`QuantizedLinear.perm`), and the
  layer's input is gathered in that order before the product.
- AWQ (GEMM layout): w[k, n] = scales[g, n] * (q[k, n] - z[g, n]), g = k // group; q packed 8 to an int32
  along n in the order 0, 2, 4, 6, 1, 3, 5, 7 (qweight [in, out / 8]), z likewise (qzeros [groups, out / 8]).
- compressed-tensors FP8 ("float-quantized", 8-bit float weights): w = weight * weight_scale, the scale per
  output channel ([out, 1]) or per tensor ([1]).

s * q - o with o = s * z equals s * (q - z): both products of an f16 scale and an integer of at most 4 bits
are exact in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's GEMM packing: nibble i of an int32 holds column AWQ_ORDER[i]


@dataclass(frozen=True)
class QuantizedLinear:
    """One linear layer's weight as batchq keeps it: w = s * q - o per group of `group` input rows (in the
    order `perm` gives, when set) and output."""

    q: Tensor  # [out, in] uint8 (4 bits: 0..15) or int8 (8 bits)
    s: Tensor  # [out, in / group] float32
    o: Tensor  # [out, in / group] float32
    group: int
    bits: int
    perm: Tensor | None = None  # [in] int64: input row k' of q is the layer's input row perm[k']


@dataclass(frozen=True)
class QuantConfig:
    """What a checkpoint's quantization_config says about its linear weights."""

    method: str  # "gptq" | "awq" | "fp8"
    bits: int
    group: int  # input rows per group (gptq, awq); 0 for fp8
    gptq_v1_zeros: bool = True  # GPTQ's original format stores each zero point minus one
    desc_act: bool = False
    modules_not_converted: tuple[str, ...] = ()  # left in float by the quantiser (e.g. lm_head)


class QuantFormatError(ValueError):
    """A quantised checkpoint batchq cannot read, or tensors that do not fit its config: one line."""


def quant_config(hf_config: Any) -> QuantConfig | None:
    """The checkpoint's quantization_config as a QuantConfig; None for an unquantised model. Raises
    QuantFormatError for a method or variant batchq does not read, naming it."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    qc: dict[str, Any] = raw if isinstance(raw, dict) else raw.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    skip = tuple(qc.get("modules_to_not_convert") or qc.get("ignore") or ())
    if method == "gptq":
        bits, group = int(qc.get("bits", 4)), int(qc.get("group_size", 128))
        if bits not in (4, 8):
            raise QuantFormatError(f"GPTQ with {bits} bits: batchq reads 4 and 8")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantFormatError(f"GPTQ checkpoint_format {fmt!r}: batchq reads 'gptq' and 'gptq_v2'")
        return QuantConfig("gptq", bits, group, fmt == "gptq", bool(qc.get("desc_act", False)), skip)
    if method == "awq":
        bits, group = (
            int(qc.get("bits", qc.get("w_bit", 4))),
            int(qc.get("group_size", qc.get("q_group_size", 128))),
        )
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm":
            raise QuantFormatError(f"AWQ {bits}-bit {version!r}: batchq reads the 4-bit GEMM layout")
        if not qc.get("zero_point", True):
            raise QuantFormatError("AWQ without zero points: batchq reads zero-point AWQ")
        return QuantConfig("awq", 4, group, modules_not_converted=skip)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, skip)
    raise QuantFormatError(
        f"quantization method {method!r}: batchq reads gptq, awq and compressed-tensors FP8 weights"
    )


def _compressed_tensors(qc: dict[str, Any], skip: tuple[str, ...]) -> QuantConfig:
    groups = qc.get("config_groups") or {}
    weights = [g.get("weights") or {} for g in groups.values()]
    if qc.get("format") != "float-quantized" or not weights:
        raise QuantFormatError(
            f"compressed-tensors format {qc.get('format')!r}: batchq reads float-quantized (FP8) weights"
        )
    for w in weights:
        if (
            w.get("type") != "float"
            or int(w.get("num_bits", 0)) != 8
            or w.get("strategy") not in ("channel", "tensor")
        ):
            raise QuantFormatError(
                f"compressed-tensors weights {w.get('num_bits')}-bit {w.get('type')} by {w.get('strategy')}: "
                "batchq reads 8-bit float weights scaled per channel or per tensor"
            )
    return QuantConfig("fp8", 8, 0, modules_not_converted=skip)


def _unpack_int32(packed: Tensor, bits: int, dim: int) -> Tensor:
    """int32 words holding 32 / bits values each (value i at bits i * bits, little end first) -> the values
    as int32, spread along `dim`."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    vals = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per]
    vals = vals.movedim(dim, -2) if dim != packed.dim() - 1 else vals
    out = vals.reshape(*vals.shape[:-2], vals.shape[-2] * per)
    return out.movedim(-1, dim) if dim != packed.dim() - 1 else out


def gptq(
    qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor | None, cfg: QuantConfig
) -> QuantizedLinear:
    """A GPTQ linear: qweight [in / (32 / bits), out] int32, qzeros [groups, out / (32 / bits)] int32,
    scales [groups, out] float16, g_idx [in] int32 (None: k // group)."""
    bits = cfg.bits
    q = _unpack_int32(qweight, bits, dim=0).t()  # [out, in]
    z = _unpack_int32(qzeros, bits, dim=1)  # [groups, out]
    if cfg.gptq_v1_zeros:  # stored as z - 1, wrapped within the bits (as AutoGPTQ reads them back)
        z = (z + 1) & ((1 << bits) - 1)
    n, k = q.shape
    groups = scales.shape[0]
    if scales.shape != (groups, n) or z.shape != (groups, n) or k % cfg.group or k // cfg.group != groups:
        raise QuantFormatError(
            f"GPTQ tensors do not fit: qweight gives [{n}, {k}], scales {tuple(scales.shape)}, zeros "
            f"{tuple(z.shape)}, group size {cfg.group}"
        )
    perm = None
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // cfg.group):
        perm = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[perm], torch.arange(k) // cfg.group):
            raise QuantFormatError("GPTQ g_idx does not give every group the same number of rows")
        q = q[:, perm]
    s = scales.float().t().contiguous()  # [out, groups]
    o = s * z.float().t()
    if bits == 4:
        return QuantizedLinear(q.to(torch.uint8).contiguous(), s, o.contiguous(), cfg.group, 4, perm)
    # 8 bits: q - 128 as int8, its offset folded into o: s * (q - z) = s * (q - 128) - s * (z - 128)
    return QuantizedLinear((q - 128).to(torch.int8).contiguous(), s, (s * (z.float().t() - 128)).contiguous(),
                           cfg.group, 8, perm)  # fmt: skip


def awq(qweight: Tensor, qzeros: Tensor, scales: Tensor, cfg: QuantConfig) -> QuantizedLinear:
    """An AWQ (GEMM) linear: qweight [in, out / 8] int32, qzeros [groups, out / 8] int32, scales [groups,
    out] float16."""
    order = torch.tensor(AWQ_ORDER)
    inverse = torch.argsort(order)  # column j of a word's 8 sits in nibble inverse[j]

    def columns(packed: Tensor) -> Tensor:
        vals = _unpack_int32(packed, 4, dim=1)  # [rows, out] in packing order
        r, n = vals.shape
        return vals.view(r, n // 8, 8)[..., inverse].reshape(r, n)

    q, z = columns(qweight), columns(qzeros)  # [in, out], [groups, out]
    k, n = q.shape
    groups = scales.shape[0]
    if scales.shape != (groups, n) or z.shape != (groups, n) or k % cfg.group or k // cfg.group != groups:
        raise QuantFormatError(
            f"AWQ tensors do not fit: qweight gives [{n}, {k}], scales {tuple(scales.shape)}, zeros "
            f"{tuple(z.shape)}, group size {cfg.group}"
        )
    s = scales.float().t().contiguous()
    return QuantizedLinear(
        q.t().to(torch.uint8).contiguous(), s, (s * z.float().t()).contiguous(), cfg.group, 4
    )


def fp8(weight: Tensor, weight_scale: Tensor) -> tuple[Tensor, Tensor]:
    """A compressed-tensors FP8 linear: weight [out, in] float8_e4m3fn, weight_scale [out, 1] or [1] ->
    (weight, a float32 scale per output)."""
    n = weight.shape[0]
    if weight.dtype != torch.float8_e4m3fn:
        raise QuantFormatError(f"FP8 weight of dtype {weight.dtype}: batchq reads float8_e4m3fn")
    scale = weight_scale.float().reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(n)
    if scale.shape != (n,):
        raise QuantFormatError(
            f"FP8 weight_scale {tuple(weight_scale.shape)} for a [{n}, ...] weight: batchq reads scales per "
            "channel or per tensor"
        )
    return weight, scale.contiguous()


def dequantize(ql: QuantizedLinear) -> Tensor:
    """The float32 [out, in] weight in the layer's own input order (the reference formula)."""
    s = ql.s.repeat_interleave(ql.group, dim=1)
    o = ql.o.repeat_interleave(ql.group, dim=1)
    w = torch.addcmul(-o, ql.q.float(), s)
    if ql.perm is not None:
        w = w[:, torch.argsort(ql.perm)]
    return w
