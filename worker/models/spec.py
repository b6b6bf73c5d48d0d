"""DecoderSpec: the shape and the variants of one decoder, read from a Hugging Face config.

Plain data, no torch: the loader fills it from the config and its family (families.SUPPORTED), the decoder
(llama.py) is built from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # per head (Qwen3)
    tie_embeddings: bool
    qk_norm_over_projection: bool = False  # OLMo 2: over all of q and all of k, before the heads split
    post_norms: bool = False  # OLMo 2: h + norm(attn(h)), h + norm(mlp(h)), no pre-norm
    # Granite: embeddings times embedding_multiplier, each sublayer's output times residual_multiplier
    # before the residual add, attention_multiplier as the softmax scale, logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None  # None: head_dim ** -0.5
    logits_scaling: float = 1.0

    @classmethod
    def from_hf_config(
        cls,
        cfg: Any,
        qk_norm: bool,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm_over_projection: bool = False,
        post_norms: bool = False,
    ) -> DecoderSpec:
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            rms_norm_eps=cfg.rms_norm_eps,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=qk_norm,
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qk_norm_over_projection=qk_norm_over_projection,
            post_norms=post_norms,
            embedding_multiplier=float(getattr(cfg, "embedding_multiplier", 1.0)),
            residual_multiplier=float(getattr(cfg, "residual_multiplier", 1.0)),
            attention_multiplier=getattr(cfg, "attention_multiplier", None),
            logits_scaling=float(getattr(cfg, "logits_scaling", 1.0)),
        )
