"""A mixture-of-experts family's MoESpec, read from its Hugging Face config as its modeling code reads it.

No torch: families.py imports this before anything heavy loads.
"""

from __future__ import annotations

from typing import Any

from worker.models.spec import MoEKind, MoESpec, UnsupportedLayers

__all__ = ["MoEKind", "moe_spec"]


def moe_spec(cfg: Any, kind: MoEKind) -> MoESpec:
    """The experts of a `kind` config. Raises UnsupportedLayers for a config its layers do not compute."""
    layers = int(cfg.num_hidden_layers)
    if kind in ("mixtral", "gpt_oss"):
        experts, inter = int(cfg.num_local_experts), int(cfg.intermediate_size)
        sparse = (True,) * layers
    else:
        experts, inter = int(cfg.num_experts), int(cfg.moe_intermediate_size)
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(cfg, "mlp_only_layers", None) or [])
        # Hugging Face: experts where the layer is not mlp_only and (layer + 1) % decoder_sparse_step == 0
        sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers))
    top_k = int(cfg.num_experts_per_tok)
    if any(sparse) and not 1 <= top_k <= experts:
        raise UnsupportedLayers(f"num_experts_per_tok {top_k}: expected 1 to {experts} (the experts)")
    if kind == "gpt_oss":
        return MoESpec(
            experts, top_k, inter, sparse, routing="topk_softmax", norm_topk_prob=False,
            activation="clamped_swiglu", swiglu_alpha=float(cfg.swiglu_alpha),
            swiglu_limit=float(cfg.swiglu_limit), expert_bias=True, router_bias=True, kind=kind,
        )  # fmt: skip
    norm = True if kind == "mixtral" else bool(cfg.norm_topk_prob)
    shared = int(cfg.shared_expert_intermediate_size) if kind == "qwen2_moe" else None
    return MoESpec(experts, top_k, inter, sparse, norm_topk_prob=norm, shared_intermediate=shared, kind=kind)
