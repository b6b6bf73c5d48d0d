"""DecoderSpec: the shape and the variants of one decoder, read from a Hugging Face config; and each layer's
sliding window as transformers decides it (`sliding_windows`).

Plain data, no torch: the loader fills it from the config and its family (families.SUPPORTED), the decoder
(llama.py) is built from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# How a family's Hugging Face code decides which layers slide (its mask is the truth):
# - "none": no layer (Llama, Granite, OLMo 2 build a plain causal mask whatever the config holds);
# - "every_layer": every layer, by config.sliding_window where it is set (Mistral, Phi-3, Starcoder2: their
#   mask is the sliding one whenever sliding_window is not None; they ignore layer_types);
# - "layer_types": config.layer_types, "sliding_attention" layers by config.sliding_window (Qwen2 and Qwen3
#   derive the list from use_sliding_window and max_window_layers: layers from max_window_layers on slide;
#   Gemma 2 / 3, and transformers' create_masks_for_generate for any config that has the list).
WindowRule = Literal["none", "every_layer", "layer_types"]
LAYER_TYPES = {"full_attention": False, "sliding_attention": True}  # the types batchq's attention computes


# The MLP activations the native decoder computes, by transformers' ACT2FN names (Gemma's tanh GELU too)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
HIDDEN_ACTIVATION = ("gemma2", "gemma3_text")  # model types whose MLP reads config.hidden_activation
# image-text model types -> their decoder's (in text_config)
TEXT_CONFIG = {
    "gemma3": "gemma3_text",
    "qwen2_vl": "qwen2_vl_text",
    "qwen2_5_vl": "qwen2_5_vl_text",
    "llava": "llama",
}


def activation(cfg: Any) -> Any:
    """The MLP's activation as the family's Hugging Face MLP reads it: Gemma's from hidden_activation (its
    checkpoints may carry a hidden_act beside it, which Gemma 2 / 3 ignore), every other's from hidden_act.
    cfg: a config, or config.json's dict."""

    def get(key: str) -> Any:
        return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)

    model_type = get("model_type")
    if model_type in TEXT_CONFIG:  # the decoder's, in its text_config (a config, or a dict in config.json)
        text = get("text_config") or {}
        return activation({"model_type": TEXT_CONFIG[model_type]} | text if isinstance(text, dict) else text)
    if model_type in HIDDEN_ACTIVATION:  # its config's default where a checkpoint omits it
        return get("hidden_activation") or "gelu_pytorch_tanh"
    return get("hidden_act") or "silu"


class UnsupportedLayers(ValueError):
    """A config whose layers attend in a way batchq's kernels do not compute (chunked, linear, ...), or
    that names sliding layers without a window."""


def sliding_windows(cfg: Any, rule: WindowRule) -> tuple[int | None, ...]:
    """Each layer's sliding window under `rule`: the keys a query sees, its own included (transformers'
    mask keeps kv_idx > q_idx - sliding_window), or None for full attention. Raises UnsupportedLayers."""
    layers = int(cfg.num_hidden_layers)
    window = getattr(cfg, "sliding_window", None)
    if window == 0 and not getattr(cfg, "use_sliding_window", True):  # Qwen2-MoE's "no window"
        window = None
    if window is not None and (not isinstance(window, int) or window < 1):
        raise UnsupportedLayers(f"sliding_window {window!r}: expected a positive number of tokens")
    if rule == "none":
        return (None,) * layers
    if rule == "every_layer":
        return (window,) * layers
    types = getattr(cfg, "layer_types", None)
    if types is None:  # create_masks_for_generate: without the list, sliding_window applies to every layer
        return (window,) * layers
    if len(types) != layers:
        raise UnsupportedLayers(f"layer_types names {len(types)} layers, the model has {layers}")
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise UnsupportedLayers(
            f"layer types {unknown}: batchq's attention computes {sorted(LAYER_TYPES)} only"
        )
    if window is None and "sliding_attention" in types:
        raise UnsupportedLayers(
            "layer_types has sliding_attention layers but the config sets no sliding_window"
        )
    return tuple(window if LAYER_TYPES[t] else None for t in types)


Routing = Literal["softmax_topk", "topk_softmax"]
# How a family's checkpoint names its router and experts (moe.MoE.slots): mixtral: block_sparse_moe.{gate,
# experts.E.w1/w3/w2}; qwen2_moe / qwen3_moe: mlp.{gate, experts.E.gate_proj/up_proj/down_proj} (Qwen2-MoE
# with mlp.shared_expert and mlp.shared_expert_gate); gpt_oss: mlp.{router, experts.gate_up_proj [E, hidden,
# 2I] (gate and up interleaved), experts.down_proj [E, I, hidden]} with biases, and self_attn.sinks.
MoEKind = Literal["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"]
Activation = Literal["silu", "clamped_swiglu"]


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP as its family's Hugging Face code computes it.

    routing: "softmax_topk" (Mixtral, Qwen2/3-MoE: softmax over every expert's logit, the top_k kept, then
    renormalised to sum 1 where norm_topk_prob) or "topk_softmax" (gpt-oss: the top_k logits, router bias
    included, then a softmax over those). activation: "silu" (silu(gate) * up) or "clamped_swiglu"
    (gpt-oss: gate clamped above at `limit`, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)).
    sparse_layers: which layers hold experts (Qwen2/3-MoE's decoder_sparse_step and mlp_only_layers; the
    others a dense MLP of the config's intermediate_size). shared_intermediate: Qwen2-MoE's shared expert,
    its output times sigmoid(shared_expert_gate(x)), added to the experts'; None: none."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    sparse_layers: tuple[bool, ...]
    routing: Routing = "softmax_topk"
    norm_topk_prob: bool = True
    activation: Activation = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False  # gpt-oss: a bias per expert on gate_up and on down
    router_bias: bool = False
    shared_intermediate: int | None = None
    kind: MoEKind = "qwen3_moe"


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
    # Per layer: its sliding window (keys a query sees, its own included) or None (full attention); empty:
    # no layer slides. attention_softcap: scores = softcap * tanh(scores / softcap) before the softmax, in
    # every layer (Gemma 2's attn_logit_softcapping); None: none.
    layer_windows: tuple[int | None, ...] = ()
    attention_softcap: float | None = None
    moe: MoESpec | None = None  # None: a dense MLP in every layer
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax's denominator
    # Gemma 2 / 3: every RMSNorm scales by (1 + w), in float32 before the cast back (norm_plus_one); each
    # sublayer between two norms, input_layernorm / post_attention_layernorm around attention and
    # pre_feedforward_layernorm / post_feedforward_layernorm around the MLP (sandwich_norms); embeddings
    # times hidden ** 0.5 rounded to the model dtype, as Hugging Face's normalizer tensor is
    # (embedding_normalizer); logits soft-capped, cap * tanh(logits / cap) (final_softcap); sliding layers
    # rotated by their own table, of rope_local_base_freq (Gemma 3: local_rope).
    activation: str = "silu"  # the MLP's gate activation, a name of transformers' ACT2FN (ACTIVATIONS)
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    embedding_normalizer: float | None = None
    final_softcap: float | None = None
    local_rope: bool = False
    # M-RoPE (Qwen2-VL): the rotary frequencies in sections of (temporal, height, width) positions, in
    # pairs of head dims; None: one position per token
    mrope_section: tuple[int, ...] | None = None

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def widest_window(self) -> int | None:
        """The largest window where every layer has one (what a sequence's cache must keep), else None."""
        windows = [self.window(i) for i in range(self.num_layers)]
        return None if not windows or None in windows else max(w for w in windows if w is not None)

    @classmethod
    def from_hf_config(
        cls,
        cfg: Any,
        qk_norm: bool,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm_over_projection: bool = False,
        post_norms: bool = False,
        windows: WindowRule = "none",
        moe: MoESpec | None = None,
        attention_sinks: bool = False,
        gemma: bool = False,
    ) -> DecoderSpec:
        """Raises UnsupportedLayers where sliding_windows does. gemma: Gemma 2 / 3's norms, embedding
        normalizer, softmax scale (query_pre_attn_scalar ** -0.5), soft-caps and Gemma 3's local rotary."""
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        attention_multiplier = getattr(cfg, "attention_multiplier", None)
        if gemma:
            if getattr(cfg, "use_bidirectional_attention", False):
                raise UnsupportedLayers("use_bidirectional_attention: batchq's attention is causal")
            attention_multiplier = float(cfg.query_pre_attn_scalar) ** -0.5
        rope = getattr(cfg, "rope_parameters", None)
        local_rope = gemma and isinstance(rope, dict) and "sliding_attention" in rope
        mrope = rope.get("mrope_section") if isinstance(rope, dict) else None
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
            attention_multiplier=attention_multiplier,
            logits_scaling=float(getattr(cfg, "logits_scaling", 1.0)),
            layer_windows=sliding_windows(cfg, windows),
            attention_softcap=getattr(cfg, "attn_logit_softcapping", None),
            moe=moe,
            attention_sinks=attention_sinks,
            activation=activation(cfg),
            norm_plus_one=gemma,
            sandwich_norms=gemma,
            embedding_normalizer=float(cfg.hidden_size) ** 0.5 if gemma else None,
            final_softcap=getattr(cfg, "final_logit_softcapping", None) if gemma else None,
            local_rope=local_rope,
            mrope_section=tuple(int(x) for x in mrope) if mrope else None,
        )
