"""Model loading: a resolved checkpoint (resolve.py) on the path families.py picks. The native path builds
our decoder empty on the target device and streams the checkpoint's tensors into it (weights.py); no
Hugging Face model is built. The transformers fallback loads Hugging Face's model, whose modules it runs.
Config, tokenizer and generation config come from transformers either way.

A checkpoint that cannot be read raises ModelLoadError with one line that says what was tried. torch and the
decoder are imported where they are used: `worker` imports this module's neighbours before torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from worker.models.errors import ModelLoadError, reading
from worker.models.families import (
    SUPPORTED,
    causal_lm_class,
    check_architecture,
    check_causal_lm,
    decoder_config,
    implementation,
    text_weight,
)
from worker.models.moe_config import moe_spec
from worker.models.quant_formats import QuantFormatError, quant_config
from worker.models.resolve import gguf_checkpoint, gguf_source, resolve_checkpoint, weights_folder
from worker.models.sharding import ShardingError
from worker.models.spec import UnsupportedLayers, activation

# M-RoPE decoders' rotary modules (a text decoder of an image-text model, without a causal LM class)
MROPE_ROTARY = {
    "qwen2_vl_text": ("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VLRotaryEmbedding"),
    "qwen2_5_vl_text": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLRotaryEmbedding"),
}

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from worker.models.layers import RotaryTable
    from worker.models.llama import LlamaFamilyModel
    from worker.models.spec import DecoderSpec
    from worker.models.transformers_model import TransformersModel
    from worker.parallel.group import TPGroup

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    model: LlamaFamilyModel | TransformersModel
    tokenizer: Any
    hf_config: Any
    eos_token_ids: list[int]
    max_model_len: int
    checkpoint_dir: str  # a local HF directory (the GGUF cache for .gguf inputs) or the hub id
    implementation: Literal["native", "transformers"] = "native"  # which path runs it (`implementation`)
    # A checkpoint of the bare decoder with no LM head (Qwen3-Embedding-8B): its tied table stands in for the
    # head it lacks, and it answers embedding requests only
    embedding_only: bool = False
    vision: Any = (
        None  # an image-text model's vision side (models/vision.py VisionTower), where it runs images
    )


def collect_eos_ids(hf_config: Any, generation_config: Any) -> list[int]:
    ids: list[int] = []
    for src in (hf_config, generation_config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        for e in [eos] if isinstance(eos, int) else list(eos or []):
            if e not in ids:
                ids.append(int(e))
    return ids


def context_length(hf_config: Any) -> int:
    """The model's context: its max_position_embeddings, whatever its layers' sliding windows (every
    attention path computes them)."""
    return int(hf_config.max_position_embeddings)


def _windows_summary(windows: tuple[int | None, ...]) -> str:
    """e.g. "layers 0-1 full, 2-3 window 4096"."""
    runs: list[tuple[int, int, int | None]] = []
    for i, w in enumerate(windows):
        if runs and runs[-1][2] == w and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i, w)
        else:
            runs.append((i, i, w))
    parts = [
        f"{a}" + (f"-{b}" if b > a else "") + (" full" if w is None else f" window {w}") for a, b, w in runs
    ]
    return "layers " + ", ".join(parts)


def _long_rope(hf_config: Any, device: torch.device) -> tuple[torch.Tensor, int] | None:
    """LongRoPE (Phi-3): the long factors' inv_freq and the first position they rotate, else None.

    Hugging Face rotates a sequence of up to original_max_position_embeddings tokens with the short factors,
    a longer one with the long factors at every position: its generate recomputes the whole cache with the
    long factors at the step that crosses the threshold. A paged cache is not rewritten, so our table
    rotates positions below the threshold with the short factors and the rest with the long ones: exact
    for every sequence that stays within the threshold. A longer one keeps the short rotation on its first
    positions, so attention from past the threshold to before it compares keys and queries rotated by
    different factors (the load warns where the context allows such sequences). vLLM instead rotates every
    position with the long factors wherever max_model_len passes the threshold: no sequence mixes the two,
    and none that fits within it is exact. Ours keeps a position's K independent of its sequence's length,
    so the prefix cache and batch independence hold as for every other model; Hugging Face's results past
    the threshold would need a rope choice per sequence and a recompute at the crossing."""
    rope = getattr(hf_config, "rope_parameters", None)
    if not isinstance(rope, dict) or rope.get("rope_type") != "longrope":
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    threshold = int(
        rope.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings
    )
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, device, seq_len=threshold + 1)
    return long_inv_freq, threshold


def load_model(
    model: str,
    dtype: torch.dtype,
    device: torch.device,
    model_impl: str = "auto",
    fallback_dtype: torch.dtype | None = None,
    tp: TPGroup | None = None,
) -> LoadedModel:
    """Load `model` (see check_model_reference for what it may name) on the path `implementation` picks
    (model_impl: auto | native | transformers). fallback_dtype: what the transformers fallback computes in
    where it differs from the native decoder's (None: dtype). tp: this rank's tensor-parallel group (its
    share of the native decoder is loaded). A reference or checkpoint that cannot be loaded, or a model
    neither path runs exactly, raises ModelLoadError."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    ckpt = resolve_checkpoint(model)
    with reading(model, "its config.json"):
        hf_config = AutoConfig.from_pretrained(ckpt)
    model_type = getattr(hf_config, "model_type", None)
    hidden_act = activation(hf_config)
    check_architecture(
        model,
        model_type,
        getattr(hf_config, "architectures", None),
        hidden_act,
        getattr(hf_config, "is_encoder_decoder", False),
    )
    path = implementation(model_type, hidden_act, model_impl)
    if path == "transformers":
        check_causal_lm(model, hf_config)
    decoder = decoder_config(hf_config) if path == "native" else hf_config  # Gemma 3's text_config
    with reading(model, "its tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(ckpt)
    try:
        gen_config = GenerationConfig.from_pretrained(ckpt)
    except OSError:  # no generation_config.json: what transformers derives from the config
        gen_config = GenerationConfig.from_model_config(hf_config)
    max_len = context_length(decoder)
    ours: LlamaFamilyModel | TransformersModel
    headless, vision = False, None
    gguf = gguf_source(ckpt)  # a GGUF's metadata folder: its weights are in the file
    if tp is not None and tp.size > 1 and path != "native":
        raise ModelLoadError(f"model {model!r} runs on the transformers fallback, which has no tensor "
                             "parallelism: use tensor_parallel_size = 1")  # fmt: skip
    if path == "native" and gguf is not None:
        with reading(model, "its weights"):
            ours = _native_gguf(model, gguf, decoder, max_len, dtype, device, tp)
    elif path == "native":
        with reading(model, "its weights"):
            ours, headless = _native(
                model, weights_folder(ckpt), hf_config, decoder, max_len, dtype, device, tp
            )
            vision = _vision(model, weights_folder(ckpt), hf_config, dtype, device, tp)
    else:  # Hugging Face's model, from the dequantised checkpoint of a GGUF
        source = str(gguf_checkpoint(gguf)) if gguf else ckpt
        ours = _fallback(model, source, max_len, fallback_dtype or dtype, device)
    if path == "native":
        text = f" (its text_config, {decoder.model_type})" if decoder is not hf_config else ""
        log.info("native decoder: %s%s", model_type, text)
    return LoadedModel(
        name=model,
        model=ours,
        tokenizer=tokenizer,
        hf_config=hf_config,
        eos_token_ids=collect_eos_ids(decoder, gen_config),
        max_model_len=max_len,
        checkpoint_dir=ckpt,
        implementation=path,
        embedding_only=headless,
        vision=vision,
    )


def _vision(
    model: str, folder: Path, hf_config: Any, dtype: torch.dtype, device: torch.device, tp: TPGroup | None
) -> Any:
    """An image-text checkpoint's vision side where batchq runs its images (models/vision.py), else None."""
    from worker.models.vision import ImageError, load_vision

    if tp is not None and tp.size > 1:
        return None  # (a tensor-parallel engine serves such a model's text only)
    try:
        return load_vision(folder, hf_config, dtype, device)
    except ImageError as e:
        raise ModelLoadError(f"model {model!r}: {e}") from None


def _fallback(
    model: str, ckpt: str, max_len: int, dtype: torch.dtype, device: torch.device
) -> TransformersModel:
    """The transformers fallback runs Hugging Face's own modules, so it loads Hugging Face's model."""
    from transformers import AutoModelForCausalLM

    from worker.models.transformers_model import fallback_model

    with reading(model, "its weights"):
        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype)
    moved: Any = hf.to(device)  # type: ignore[arg-type]  # transformers' stub for .to() takes a model
    try:
        ours = fallback_model(moved.eval(), max_len)
    except ValueError as e:
        raise ModelLoadError(
            f"model {model!r}: the transformers fallback cannot run it exactly: {e}"
        ) from None
    log.info("transformers fallback: %s", hf.config.model_type)
    return ours


def _native(
    model: str,
    folder: Path,
    hf_config: Any,
    decoder: Any,
    max_len: int,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup | None = None,
) -> tuple[LlamaFamilyModel, bool]:
    """Our decoder, built empty on `device` in `dtype`, its weights streamed from the checkpoint's files
    (no Hugging Face model: the host holds the weights once, plus a tensor's staging at most). decoder: the
    decoder's config, hf_config's text_config in an image-text checkpoint (whose other tensors are not
    read). -> the model, and whether the checkpoint lacks an LM head (see _bare_decoder)."""
    from worker.models.llama import LlamaFamilyModel
    from worker.models.quant_loading import assemble, quantised_linears
    from worker.models.weights import Checkpoint, WeightSource

    try:
        quant = quant_config(hf_config)
    except QuantFormatError as e:
        raise ModelLoadError(f"model {model!r}: {e}") from None
    with Checkpoint(folder, quantized=quant is not None) as checkpoint:
        names, bare = checkpoint.names, _bare_decoder(checkpoint.names)
        tensors: Iterator[tuple[str, Tensor | WeightSource]] = checkpoint.tensors()
        if decoder is not hf_config:  # the text decoder's tensors only (the others are never read)
            names = {n for x in names if (n := text_weight(x))}
            tensors = ((n, w) for x, w in tensors if (n := text_weight(x)))
        elif bare:
            names = {_causal_lm_name(n) for n in names}
            tensors = ((_causal_lm_name(n), t) for n, t in tensors)
        try:
            tie = None if decoder is hf_config else bool(getattr(hf_config, "tie_word_embeddings", True))
            spec = _spec(decoder, names, tie)
        except UnsupportedLayers as e:
            raise ModelLoadError(f"model {model!r}: {e}") from None
        headless = bare and "lm_head.weight" not in names and not spec.tie_embeddings
        if headless:  # the embedding table stands in for the missing head; nothing generates with it
            spec = dataclasses.replace(spec, tie_embeddings=True)
        if bare:
            log.info("a bare decoder's checkpoint (no 'model.' prefix%s)",
                     ", no LM head: embedding requests only" if headless else "")  # fmt: skip
        rotary, local = _rotary(model, decoder, max_len, device)
        if quant is not None and spec.moe is not None:
            raise ModelLoadError(
                f"model {model!r}: a quantised ({quant.method}) mixture-of-experts checkpoint; batchq loads "
                "MoE experts from float checkpoints only"
            )
        modules = {} if quant is None else quantised_linears(quant, names)
        with _splitting(
            model
        ):  # a rank's share of it; its quantised linears kept as the checkpoint ships them
            ours = LlamaFamilyModel.empty(spec, rotary, dtype, device, local, tp)
            ours.prepare_quantized(modules)
        if quant is not None:
            tensors = assemble(quant, modules, tensors)
            log.info("%s checkpoint: %d linear layers kept quantised", quant.method, len(modules))
        ours.load_weights(tensors, checkpoint.where)
    return ours.eval(), headless


@contextlib.contextmanager
def _splitting(model: str) -> Iterator[None]:
    """A model the tensor-parallel group cannot split (ShardingError) as one ModelLoadError line."""
    try:
        yield
    except ShardingError as e:
        raise ModelLoadError(f"model {model!r}: {e}") from None


def _bare_decoder(names: set[str]) -> bool:
    """Whether a checkpoint holds the decoder without its causal-LM wrapper: `embed_tokens.weight`,
    `layers.N...`, `norm.weight`, as sentence-transformers saves an embedding model (Qwen3-Embedding ships
    so), rather than Hugging Face's `model.`-prefixed names."""
    return "embed_tokens.weight" in names and not any(n.startswith("model.") for n in names)


def _causal_lm_name(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


def _native_gguf(
    model: str,
    gguf: Path,
    hf_config: Any,
    max_len: int,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup | None = None,
) -> LlamaFamilyModel:
    """Our decoder with a GGUF file's weights, its linears kept in the file's quantisation (gguf_weights).
    tp: this rank's group (its share of each tensor kept, the tensor decoded whole first)."""
    from worker.models.gguf_weights import GGUFCheckpoint
    from worker.models.llama import FUSED_PARTS, LlamaFamilyModel

    checkpoint = GGUFCheckpoint(gguf, hf_config)
    try:
        spec = _spec(hf_config, checkpoint.names)
    except UnsupportedLayers as e:
        raise ModelLoadError(f"model {model!r}: {e}") from None
    if spec.moe is not None:
        raise ModelLoadError(f"model {model!r}: a mixture-of-experts GGUF; batchq loads MoE experts from "
                             "safetensors / pytorch_model.bin checkpoints only")  # fmt: skip
    rotary, local = _rotary(model, hf_config, max_len, device)
    with _splitting(model):
        ours = LlamaFamilyModel.empty(spec, rotary, dtype, device, local, tp)
        modules = checkpoint.keep_quantised(ours.hf_linear_modules(), FUSED_PARTS)
        ours.prepare_quantized(modules)
    log.info("GGUF %s: %d linear layers kept quantised", gguf.name, len(modules))
    ours.load_weights(checkpoint.tensors(), checkpoint.where)
    return ours.eval()


def _spec(hf_config: Any, names: set[str], tie: bool | None = None) -> DecoderSpec:
    """tie: whether the embeddings are tied where the config's own flag is not what decides (an image-text
    model ties by its top-level config, transformers' tie_weights, not by its text_config's)."""
    from worker.models.spec import DecoderSpec

    family = SUPPORTED[str(hf_config.model_type)]
    attn_bias = bool(getattr(hf_config, "attention_bias", False))
    qkv_bias = attn_bias if family.qkv_bias is None else family.qkv_bias
    if family.qkv_bias_field is not None:
        qkv_bias = bool(getattr(hf_config, family.qkv_bias_field))
    spec = DecoderSpec.from_hf_config(
        hf_config,
        qk_norm=family.qk_norm == "head",
        qkv_bias=qkv_bias,
        o_bias=attn_bias,
        qk_norm_over_projection=family.qk_norm == "projection",
        post_norms=family.post_norms,
        windows=family.windows,
        moe=None if family.moe is None else moe_spec(hf_config, family.moe),
        attention_sinks=family.moe == "gpt_oss",
        gemma=family.gemma,
    )
    if tie is not None:
        spec = dataclasses.replace(spec, tie_embeddings=tie)
    if any(w is not None for w in spec.layer_windows):
        log.info("sliding windows per layer: %s", _windows_summary(spec.layer_windows))
    if spec.tie_embeddings and {"lm_head.weight", "model.embed_tokens.weight"} <= names:
        # Both tables in a checkpoint whose config ties them (every pytorch_model.bin holds both): Hugging
        # Face ties them only where they are equal, so two tables serve either case exactly.
        log.info("tied embeddings, but the checkpoint holds lm_head.weight too: loading both tables")
        spec = dataclasses.replace(spec, tie_embeddings=False)
    return spec


def _rotary(
    model: str, hf_config: Any, max_len: int, device: torch.device
) -> tuple[RotaryTable, RotaryTable | None]:
    """The cos/sin tables, every layer's and Gemma 3's sliding layers' (or None), from a fresh Hugging Face
    rotary module of the model's own class: it computes inv_freq in float32 for whatever rope type the config
    names, without any weights. Gemma 3's module holds one per layer type: the full layers' (rope_theta and its scaling)
    first, the sliding layers' (rope_local_base_freq) last; every other model has one table, and None."""
    import torch

    from worker.models.layers import RotaryTable

    mrope = MROPE_ROTARY.get(str(getattr(hf_config, "model_type", None)))
    if mrope is not None:  # a vision-language decoder: no causal LM class of its own
        rotary_cls = getattr(importlib.import_module(mrope[0]), mrope[1])
    else:
        cls = causal_lm_class(model, hf_config)
        rotary_cls = getattr(
            sys.modules[cls.__module__], cls.__name__.removesuffix("ForCausalLM") + "RotaryEmbedding"
        )
    rotary_hf = rotary_cls(config=hf_config)
    if hasattr(rotary_hf, "inv_freq"):
        tables = [(rotary_hf.inv_freq, rotary_hf.attention_scaling), None]
    else:  # per layer type (Gemma 3): each type's inv_freq and scaling, where the config has that type
        tables = [
            (getattr(rotary_hf, f"{t}_inv_freq"), getattr(rotary_hf, f"{t}_attention_scaling"))
            if hasattr(rotary_hf, f"{t}_inv_freq")
            else None
            for t in ("full_attention", "sliding_attention")
        ]
        if tables[0] is None:  # every layer slides: the sliding table serves them all
            tables = [tables[1], None]
    assert tables[0] is not None
    inv_freq = tables[0][0].to(device)
    long_rope = _long_rope(hf_config, device)
    if long_rope is not None and max_len > long_rope[1]:
        log.warning(
            "LongRoPE: exact for sequences of up to %d tokens; a longer one keeps the short factors' rotation "
            "on its first %d positions where Hugging Face rotates all with the long factors (max_model_len = "
            "%d serves only exact ones)",
            long_rope[1], long_rope[1], long_rope[1],
        )  # fmt: skip
    with torch.device(device):  # float32 (exact), cast per step
        section = getattr(rotary_hf, "mrope_section", None) if mrope is not None else None
        main = RotaryTable(
            inv_freq, float(tables[0][1]), max_len, long_rope, tuple(section) if section else None
        )
        local = tables[1]
        return main, None if local is None else RotaryTable(local[0].to(device), float(local[1]), max_len)
