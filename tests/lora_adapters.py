"""PEFT LoRA adapters built by `peft` itself over the tests' tiny random models, with random non-zero A and B
(PEFT starts B at zero, which would hide an adapter that is never applied), and PEFT's own unmerged model
as the reference a served adapter must answer like."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.tiny_models import hf_reference

# Hugging Face's module names per family: Phi-3 fuses q/k/v and gate/up in its checkpoints (and modules)
ATTENTION = {"phi3": ["qkv_proj", "o_proj"]}
MLP = {"phi3": ["gate_up_proj", "down_proj"]}


def targets(arch: str, which: str) -> list[str]:
    """The target modules of `which` ("attention", "mlp", "all", "qv") for `arch`."""
    attn = ATTENTION.get(arch, ["q_proj", "k_proj", "v_proj", "o_proj"])
    mlp = MLP.get(arch, ["gate_proj", "up_proj", "down_proj"])
    if which == "qv":
        return ["qkv_proj"] if arch == "phi3" else ["q_proj", "v_proj"]
    return {"attention": attn, "mlp": mlp, "all": attn + mlp}[which]


def build_adapter(
    base: Path, out: Path, rank: int, modules: list[str], seed: int, alpha: float = 16.0, **settings: Any
) -> Path:
    """A PEFT adapter of `rank` on `modules` of the model saved at `base`, its A and B random, saved to
    `out` (adapter_config.json + adapter_model.safetensors). settings: more LoraConfig fields (use_rslora,
    alpha_pattern, ...)."""
    from peft import LoraConfig, get_peft_model

    model = hf_reference(base)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, lora_dropout=0.0, **settings)
    peft = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    peft.save_pretrained(out)
    return out


def peft_reference(base: Path, adapter: Path | None) -> Any:
    """PEFT's model of the adapter over the base (unmerged: B(A x) added to each layer's output), or the
    base model alone."""
    from peft import PeftModel

    model = hf_reference(base)
    return model if adapter is None else PeftModel.from_pretrained(model, adapter).eval()
