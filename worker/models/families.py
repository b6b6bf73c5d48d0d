"""The native families and which path runs a model.

SUPPORTED: the model types our decoder runs (with an activation it computes, spec.ACTIVATIONS), and what
each changes in it beyond what its config says (mixture-of-experts families: which experts' layout and
routing, moe_config.py); `implementation`: the native decoder or the transformers fallback
(EngineConfig.model_impl: auto, native, transformers); the checks that refuse what neither path runs. No
torch here: `worker` runs the architecture check before anything heavy loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from worker.models.errors import ModelLoadError
from worker.models.moe_config import MoEKind
from worker.models.spec import ACTIVATIONS, WindowRule


@dataclass(frozen=True)
class Family:
    """What a model_type changes in our decoder beyond what its config says: Granite's multipliers are
    config fields (spec.py), Phi-3's fused projections show in its checkpoint, its partial rotary factor and
    LongRoPE in the rotary table (loader._long_rope)."""

    qk_norm: Literal["none", "head", "projection"] = "none"  # Qwen3: per head; OLMo 2: over all of q / k
    qkv_bias: bool | None = None  # None: from config.attention_bias
    post_norms: bool = False  # OLMo 2: each sublayer's output normed before the residual, no pre-norm
    windows: WindowRule = "none"  # which layers slide, as the family's Hugging Face mask decides (spec.py)
    qkv_bias_field: str | None = None  # the config field that biases q/k/v (Qwen2-MoE's qkv_bias)
    moe: MoEKind | None = None  # its experts' checkpoint layout and math (moe_config.py); None: dense
    gemma: bool = False  # Gemma 2 / 3: (1 + w) norms around sublayers, soft-caps, ... (spec.from_hf_config)
    # Gemma 3's image-text checkpoints: the decoder is config.text_config (its own model type's family), its
    # weights under language_model.; the vision tower's are not read (text_weight)
    text_config: bool = False


SUPPORTED: dict[str, Family] = {
    "gemma2": Family(windows="layer_types", gemma=True),
    "gemma3": Family(text_config=True),
    "gemma3_text": Family(qk_norm="head", windows="layer_types", gemma=True),
    "granite": Family(),
    "llama": Family(),
    "mistral": Family(windows="every_layer"),
    "mixtral": Family(windows="every_layer", moe="mixtral"),
    "qwen2_moe": Family(windows="layer_types", qkv_bias_field="qkv_bias", moe="qwen2_moe"),
    "qwen3_moe": Family(qk_norm="head", windows="every_layer", moe="qwen3_moe"),
    "gpt_oss": Family(windows="layer_types", moe="gpt_oss"),
    "olmo2": Family(qk_norm="projection", post_norms=True),
    "phi3": Family(windows="every_layer"),
    "qwen2": Family(qkv_bias=True, windows="layer_types"),
    "qwen3": Family(qk_norm="head", windows="layer_types"),
    "qwen2_vl": Family(text_config=True),  # its vision tower runs beside the decoder (models/vision.py)
    "llava": Family(text_config=True),  # LLaVA-1.5: a CLIP tower and projector beside its text family
    "qwen2_vl_text": Family(qkv_bias=True, windows="layer_types"),
    "qwen2_5_vl": Family(text_config=True),
    "qwen2_5_vl_text": Family(qkv_bias=True, windows="layer_types"),
}


def decoder_config(hf_config: Any) -> Any:
    """The config of the decoder batchq runs: a multimodal family's text_config (Gemma 3's), else itself."""
    family = SUPPORTED.get(str(getattr(hf_config, "model_type", None)))
    return hf_config.text_config if family is not None and family.text_config else hf_config


# An image-text checkpoint's decoder tensors under the causal LM's names: transformers' own layout (older
# and hub checkpoints) and the one its newer model classes name; everything else (the vision tower, the
# projector) is not the decoder's.
TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                 ("language_model.lm_head.", "lm_head."))  # fmt: skip


# What an image-text checkpoint holds beside its decoder, where the decoder's own tensors are "model.*"
# (Qwen2-VL's original layout keeps its decoder there and its tower under "visual.")
NOT_TEXT = ("model.vision_tower.", "model.multi_modal_projector.", "model.visual.", "visual.")


def text_weight(name: str) -> str | None:
    """An image-text checkpoint's tensor `name` as the text decoder's causal LM names it, or None (not the
    decoder's)."""
    for prefix, ours in TEXT_PREFIXES:
        if name.startswith(prefix):
            return ours + name.removeprefix(prefix)
    if name.startswith(NOT_TEXT):
        return None
    return name if name.startswith(("lm_head.", "model.")) else None


def check_architecture(
    model: str, model_type: Any, architectures: Any, hidden_act: Any, encoder_decoder: Any = False
) -> None:
    """A native family (SUPPORTED, with an activation of spec.ACTIVATIONS), or a decoder-only `*ForCausalLM` for the transformers fallback.
    Without an architectures list the load decides (which AutoModelForCausalLM class the config maps to)."""
    if model_type in SUPPORTED and hidden_act in ACTIVATIONS:
        return  # a text_config family's architectures name its multimodal class: its decoder is what runs
    native = ", ".join(sorted(SUPPORTED))
    if encoder_decoder:
        raise ModelLoadError(
            f"model {model!r}: unsupported architecture {model_type!r} ({architectures}): an encoder-decoder; "
            f"batchq runs decoder-only models (native: {native}; others through transformers)"
        )
    if isinstance(architectures, list) and not any(str(a).endswith("ForCausalLM") for a in architectures):
        raise ModelLoadError(
            f"model {model!r}: unsupported architecture {model_type!r} ({architectures}): not a decoder-only "
            f"*ForCausalLM; supported: {native}, and other *ForCausalLM models through transformers"
        )


def implementation(model_type: Any, hidden_act: Any, model_impl: str) -> Literal["native", "transformers"]:
    """Which path runs a model: its native family where it has one (model_impl auto | native), else the
    transformers fallback. model_impl 'native' for a model without a native path raises ModelLoadError."""
    native = model_type in SUPPORTED and hidden_act in ACTIVATIONS
    if model_impl == "transformers" or (model_impl == "auto" and not native):
        return "transformers"
    if not native:
        why = (
            "activation " + repr(hidden_act) if model_type in SUPPORTED else "model_type " + repr(model_type)
        )
        raise ModelLoadError(
            f"model_impl 'native': no native path for {why} (native: {', '.join(sorted(SUPPORTED))}, with "
            f"{' / '.join(ACTIVATIONS)}); "
            "use model_impl 'auto' or 'transformers'"
        )
    return "native"


def check_causal_lm(model: str, hf_config: Any) -> None:
    """The fallback's precondition: AutoModelForCausalLM builds a `*ForCausalLM` for this config (not a
    multimodal `*ForConditionalGeneration`)."""
    cls = causal_lm_class(model, hf_config)
    if not cls.__name__.endswith("ForCausalLM"):
        raise ModelLoadError(
            f"model {model!r}: unsupported architecture {getattr(hf_config, 'model_type', None)!r}: transformers "
            f"builds {cls.__name__}, not a decoder-only *ForCausalLM (multimodal models are not served)"
        )


def causal_lm_class(model: str, hf_config: Any) -> Any:
    """The class AutoModelForCausalLM builds for this config (the class only: no model is built)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(hf_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelLoadError(
            f"model {model!r}: unsupported architecture {getattr(hf_config, 'model_type', None)!r}: "
            "transformers has no causal LM for it"
        )
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
