"""Quantised checkpoints written by the tests themselves, with the published formulas and layouts (the
packing follows AutoGPTQ's and AutoAWQ's), so no GPU quantisation library is needed: a tiny float model's
linear weights quantised min-max per group, stored as GPTQ, AWQ or compressed-tensors FP8 tensors beside its
other tensors, with the quantization_config Hugging Face writes. `reference_state` is the same model with
every quantised weight replaced by the format's reference dequantisation in float32: what HF runs to compare."""

from __future__ import annotations

import json
from pathlib import Path

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)


def quantize_asym(w: torch.Tensor, g_of_k: torch.Tensor, groups: int, bits: int):
    """Min-max asymmetric quantisation per group of input rows: q [out, in], scales and zeros [groups, out]."""
    n, k = w.shape
    top = (1 << bits) - 1
    scales = torch.empty(groups, n, dtype=torch.float16)
    zeros = torch.empty(groups, n, dtype=torch.int32)
    q = torch.empty(n, k, dtype=torch.int32)
    for g in range(groups):
        cols = (g_of_k == g).nonzero().flatten()
        wg = w[:, cols].float()
        lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
        s = ((hi - lo) / top).clamp(min=1e-5).half()
        z = torch.round(-lo / s.float()).clamp(0, top).int()
        scales[g], zeros[g] = s, z
        q[:, cols] = torch.clamp(torch.round(wg / s.float()[:, None]) + z[:, None], 0, top).int()
    return q, scales, zeros


def dequantize_ref(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_of_k: torch.Tensor
) -> torch.Tensor:
    """w[n, k] = scales[g, n] * (q[n, k] - zeros[g, n]), g = g_of_k[k], in float32."""
    return scales.float()[g_of_k].t() * (q.float() - zeros.float()[g_of_k].t())


def pack_along(vals: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack 32 / bits values per int32 along `dim`, value i at bits i * bits (or order[i] of each run)."""
    per = 32 // bits
    v = vals.movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    if order is not None:
        v = v[..., list(order)]
    words = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for i in range(per):
        words |= (v[..., i].long() & ((1 << bits) - 1)) << (bits * i)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def quantise_checkpoint(
    src: Path,
    dest: Path,
    method: str,
    bits: int = 4,
    group: int = 32,
    act_order: bool = False,
    seed: int = 0,
    same_input_order: bool = True,
    row_shares: int = 1,
) -> dict[str, torch.Tensor]:
    """Write `src` (a float checkpoint folder) as a quantised one at `dest`; returns the reference state
    dict (every quantised weight dequantised by the reference formula, float32). same_input_order=False
    gives every act-order projection its own input order (which batchq cannot fuse). row_shares: act-order
    orders o_proj's and down_proj's inputs within each of that many equal blocks only (the groups a
    tensor-parallel split over as many ranks can shard; GPTQ's own orders scatter them)."""
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (dest / f.name).write_bytes(f.read_bytes())
    sd = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    orders: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    ref = dict(sd)
    for name, w in sd.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in LINEARS:
            out[name] = w
            continue
        k = w.shape[1]
        if method == "fp8":
            scale = (w.float().abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-8)
            w8 = (w.float() / scale).to(torch.float8_e4m3fn)
            out[module + ".weight"], out[module + ".weight_scale"] = w8, scale
            ref[name] = w8.float() * scale
            continue
        g_of_k = torch.arange(k) // group
        if act_order:  # projections of one input share its order (GPTQ orders by that input's Hessian)
            shared = (
                module.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            )
            if shared not in orders or not same_input_order:
                orders[shared] = torch.randperm(k, generator=gen)
                if module.endswith(("o_proj", "down_proj")) and row_shares > 1:
                    n = k // row_shares
                    orders[shared] = torch.cat(
                        [torch.randperm(n, generator=gen) + i * n for i in range(row_shares)]
                    )
            g_of_k = torch.empty(k, dtype=torch.long)
            g_of_k[orders[shared]] = torch.arange(k) // group
        q, scales, zeros = quantize_asym(w, g_of_k, k // group, bits)
        ref[name] = dequantize_ref(q, scales, zeros, g_of_k)
        if method == "gptq":
            out[module + ".qweight"] = pack_along(q.t().contiguous(), bits, dim=0)
            out[module + ".qzeros"] = pack_along(zeros - 1, bits, dim=1)  # the original format's z - 1
            out[module + ".scales"] = scales
            out[module + ".g_idx"] = g_of_k.int()
        else:
            out[module + ".qweight"] = pack_along(q.t().contiguous(), 4, dim=1, order=AWQ_ORDER)
            out[module + ".qzeros"] = pack_along(zeros, 4, dim=1, order=AWQ_ORDER)
            out[module + ".scales"] = scales
    save_file(out, dest / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, bits, group, act_order)
    (dest / "config.json").write_text(json.dumps(config))
    return ref


def quantization_config(method: str, bits: int, group: int, act_order: bool) -> dict[str, object]:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": False,
                "checkpoint_format": "gptq"}  # fmt: skip
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                               "strategy": "channel"}}}}  # fmt: skip
