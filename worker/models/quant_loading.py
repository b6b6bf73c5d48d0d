"""A quantised checkpoint's linear layers on their way into the decoder, kept quantised.

The checkpoint holds each quantised linear as parts (GPTQ and AWQ: qweight, qzeros, scales and GPTQ's
g_idx; compressed-tensors FP8: an FP8 weight and its weight_scale) that arrive in any order, each small
beside a float weight. `assemble` collects a linear's parts, turns them into batchq's form
(quant_formats.py) once the last arrives, and passes them on under the names the decoder's quantised
Linear takes: `<linear>.weight` (q, or the FP8 weight), `<linear>.group_table` ([out, groups, 2] s and o),
`<linear>.in_perm` (act-order's input order), `<linear>.scale` (FP8's per-output scale). Every other
tensor passes through untouched. Under tensor parallelism these are whole, and each rank keeps its share
of them (sharding.decoder_shards): a module's converted tensors are the most a rank holds beyond its own.

`quantised_linears` tells the loader, from the checkpoint's tensor names alone, which of Hugging Face's
linear modules are quantised and how, so the decoder can be built with room for them before any bytes
are read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from worker.models import quant_formats
from worker.models.errors import CheckpointError
from worker.models.quant_formats import QuantConfig, QuantFormatError
from worker.models.weights import WeightSource

GROUP_PARTS = ("qweight", "qzeros", "scales", "g_idx")  # GPTQ's (AWQ's: the first three)
FP8_PARTS = ("weight", "weight_scale", "input_scale")  # input_scale: activations, which batchq keeps float


@dataclass(frozen=True)
class QuantizedModule:
    """How one of Hugging Face's linear modules is stored: its kind and (group kinds) shape."""

    kind: str  # "groups" | "fp8"
    bits: int = 0
    group: int = 0
    act_order: bool = False
    table: str = "f32"  # the (s, o) table's float type: "f32", or "f16" where the values are float16 (GGUF's)
    # the format, for messages ("GPTQ", "GGUF Q4_K"): fused parts of two formats stored alike are alike
    fmt: str = field(default="", compare=False)


def quantised_linears(cfg: QuantConfig, names: set[str]) -> dict[str, QuantizedModule]:
    """Hugging Face's module name -> how it is stored, for every quantised linear of the checkpoint."""
    out: dict[str, QuantizedModule] = {}
    if cfg.method == "fp8":
        for n in names:
            if n.endswith(".weight_scale"):
                out[n.removesuffix(".weight_scale")] = QuantizedModule("fp8", fmt="FP8")
        return out
    for n in names:
        if n.endswith(".qweight"):
            prefix = n.removesuffix(".qweight")
            act = cfg.method == "gptq" and cfg.desc_act and prefix + ".g_idx" in names
            out[prefix] = QuantizedModule("groups", cfg.bits, cfg.group, act, fmt=cfg.method.upper())
    return out


def _part(name: str, modules: dict[str, QuantizedModule]) -> tuple[str, str] | None:
    """(module, part) when `name` is a part of a quantised module that assembly consumes."""
    prefix, _, part = name.rpartition(".")
    q = modules.get(prefix)
    if q is None:
        return None
    if q.kind == "fp8":
        return (prefix, part) if part in FP8_PARTS else None
    return (prefix, part) if part in GROUP_PARTS else None


def _materialise(src: Tensor | WeightSource) -> Tensor:
    if isinstance(src, Tensor):
        return src
    t = torch.empty(src.shape, dtype=src.dtype)
    src.read_into(t)
    return t


def assemble(
    cfg: QuantConfig,
    modules: dict[str, QuantizedModule],
    tensors: Iterator[tuple[str, Tensor | WeightSource]],
) -> Iterator[tuple[str, Tensor | WeightSource]]:
    """The checkpoint's tensors with each quantised module's parts replaced by batchq's form of it (see the
    module docstring); CheckpointError names a module whose parts do not fit together or never arrive."""
    pending: dict[str, dict[str, Tensor | WeightSource]] = {}
    needed = {"gptq": {"qweight", "qzeros", "scales"}, "awq": {"qweight", "qzeros", "scales"},
              "fp8": {"weight", "weight_scale"}}  # fmt: skip
    for name, src in tensors:
        hit = _part(name, modules)
        if hit is None:
            yield name, src
            continue
        prefix, part = hit
        if part == "input_scale":
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = src if part == "weight" else _materialise(src)  # an FP8 weight is read in place later
        want = needed[cfg.method] | ({"g_idx"} if modules[prefix].act_order else set())
        if want <= parts.keys():
            yield from _converted(cfg, prefix, pending.pop(prefix), modules[prefix].act_order)
    if pending:
        prefix, parts = next(iter(pending.items()))
        raise CheckpointError(f"quantised module {prefix!r}: the checkpoint holds only its {sorted(parts)}")


def _converted(
    cfg: QuantConfig, prefix: str, parts: dict[str, Tensor | WeightSource], act_order: bool = False
) -> Iterator[tuple[str, Tensor | WeightSource]]:
    """act_order: the decoder's linear has room for an input order (quantised_linears), which it then
    takes even where this module's g_idx keeps the inputs in place."""
    t = {k: v for k, v in parts.items() if isinstance(v, Tensor)}
    try:
        if cfg.method == "fp8":
            weight = parts["weight"]
            if weight.dtype != torch.float8_e4m3fn:
                raise QuantFormatError(f"weight of dtype {weight.dtype}: batchq reads float8_e4m3fn")
            n = weight.shape[0]
            scale = t["weight_scale"].float().reshape(-1)
            if scale.numel() == 1:
                scale = scale.expand(n)
            if scale.shape != (n,):
                raise QuantFormatError(
                    f"weight_scale {list(t['weight_scale'].shape)} for a [{n}, ...] weight: batchq reads scales "
                    "per channel or per tensor"
                )
            yield prefix + ".weight", weight
            yield prefix + ".scale", scale.contiguous()
            return
        if cfg.method == "gptq":
            ql = quant_formats.gptq(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), cfg)
        else:
            ql = quant_formats.awq(t["qweight"], t["qzeros"], t["scales"], cfg)
    except QuantFormatError as e:
        raise CheckpointError(f"quantised module {prefix!r}: {e}") from None
    yield prefix + ".weight", ql.q
    yield prefix + ".group_table", torch.stack((ql.s, ql.o), dim=-1)
    if ql.perm is not None or act_order:
        yield prefix + ".in_perm", torch.arange(ql.q.shape[1]) if ql.perm is None else ql.perm
