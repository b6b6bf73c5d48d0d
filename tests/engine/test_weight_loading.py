"""Weights stream from the checkpoint's files into our decoder, bit for bit what the former path gave.

The former path is the oracle: Hugging Face's model from from_pretrained in the serving dtype, its tensors
fused and scaled as batchq used to copy them (`former_path`, below). Every native family, tied
embeddings, Phi-3's fused checkpoint, Granite's residual multiplier, sharded checkpoints with an index,
another dtype on disk than served, and pytorch_model.bin, each through the production loader.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import AutoModelForCausalLM

from tests.tiny_models import build_tiny_checkpoint
from worker.models import weights
from worker.models.layers import RotaryTable
from worker.models.llama import LlamaFamilyModel
from worker.models.loader import _long_rope, load_model

CPU = torch.device("cpu")
GRANITE = {"embedding_multiplier": 2.0, "residual_multiplier": 0.7, "attention_multiplier": 0.4,
           "logits_scaling": 1.3}  # fmt: skip
LONGROPE = {  # Phi-4-mini's: short and long factors per rotary frequency (6 of a 16-wide head's 8)
    "original_max_position_embeddings": 128,
    "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.05 * i for i in range(6)],
                        "long_factor": [1.0 + 0.6 * i for i in range(6)]},
}  # fmt: skip
FAMILIES = {
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "mistral": ("mistral", {}),
    "granite-bias": ("granite", {**GRANITE, "attention_bias": True, "mlp_bias": True}),
    "granite-tied": ("granite", {**GRANITE, "tie_word_embeddings": True}),
    "olmo2": ("olmo2", {"attention_bias": True}),
    "phi3": ("phi3", {}),
    "phi4-mini-like": ("phi3", {**LONGROPE, "partial_rotary_factor": 0.75, "tie_word_embeddings": True}),
}


def former_path(hf: object, ours: LlamaFamilyModel) -> dict[str, Tensor]:
    """Our parameters as the former loader filled them from Hugging Face's model: q/k/v and gate/up
    concatenated (Phi-3's taken fused), o_proj and down_proj times Granite's residual multiplier in the
    serving dtype, a tied table from embed_tokens."""
    sd: dict[str, Tensor] = hf.state_dict()  # type: ignore[attr-defined]
    r = float(getattr(hf.config, "residual_multiplier", 1.0))  # type: ignore[attr-defined]
    out = {"norm.weight": sd["model.norm.weight"]}
    if ours.spec.tie_embeddings:
        out["lm_head.weight"] = sd["model.embed_tokens.weight"]
    else:
        out["embed_tokens.weight"] = sd["model.embed_tokens.weight"]
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(ours.spec.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm", "post_feedforward_layernorm",
                     "self_attn.q_norm", "self_attn.k_norm"):  # fmt: skip
            if p + name + ".weight" in sd:
                out[q + name + ".weight"] = sd[p + name + ".weight"]
        for fused, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))):  # fmt: skip
            for kind in ("weight", "bias"):
                if f"{p}{fused}.{kind}" in sd:
                    out[f"{q}{fused}.{kind}"] = sd[f"{p}{fused}.{kind}"]
                elif f"{p}{parts[0]}.{kind}" in sd:
                    out[f"{q}{fused}.{kind}"] = torch.cat([sd[f"{p}{n}.{kind}"] for n in parts])
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            for kind in ("weight", "bias"):
                if f"{p}{name}.{kind}" in sd:
                    t = sd[f"{p}{name}.{kind}"]
                    out[f"{q}{name}.{kind}"] = t if r == 1.0 else t * r
    return out


def former_rotary(hf: object, max_len: int) -> Tensor:
    """The cos table the former loader built from a fresh rotary module of Hugging Face's model."""
    rotary = type(hf.model.rotary_emb)(config=hf.config)  # type: ignore[attr-defined]
    long = _long_rope(hf.config, CPU)  # type: ignore[attr-defined]
    return RotaryTable(rotary.inv_freq, float(rotary.attention_scaling), max_len, long).cos


def assert_same_as_former_path(folder: Path, dtype: torch.dtype) -> LlamaFamilyModel:
    loaded = load_model(str(folder), dtype, CPU)
    ours = loaded.model
    assert isinstance(ours, LlamaFamilyModel)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    expected = former_path(hf, ours)
    got = dict(ours.named_parameters())
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert got[name].dtype == dtype, name
        assert torch.equal(got[name], t), name
    assert torch.equal(ours.rotary.cos, former_rotary(hf, ours.max_positions))
    return ours


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch, overrides = FAMILIES[request.param]
    return request.param, build_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)


def test_every_family_loads_bit_for_bit_as_the_former_path(family: tuple[str, Path]) -> None:
    name, folder = family
    ours = assert_same_as_former_path(folder, torch.float32)
    assert ours.spec.tie_embeddings == ("tied" in name or name == "phi4-mini-like")


def reshard(folder: Path, parts: int, dtype: torch.dtype | None = None) -> None:
    """Rewrite model.safetensors as `parts` shards with an index (tensors dealt round-robin, so a fused
    projection's parts lie in different files), optionally in another dtype."""
    sd = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(sd)
    weight_map = {}
    for k in range(parts):
        shard = f"model-{k + 1:05d}-of-{parts:05d}.safetensors"
        mine = {n: sd[n] if dtype is None else sd[n].to(dtype) for n in names[k::parts]}
        save_file(mine, folder / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(mine, shard)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


@pytest.mark.parametrize("arch", ["granite-bias", "phi3", "llama-tied"])
def test_a_sharded_checkpoint_with_an_index_loads_as_the_former_path(arch: str, tmp_path: Path) -> None:
    folder = build_tiny_checkpoint(tmp_path, FAMILIES[arch][0], **FAMILIES[arch][1])
    reshard(folder, 3)
    assert_same_as_former_path(folder, torch.float32)


def test_a_bfloat16_checkpoint_served_in_float32_and_back(tmp_path: Path) -> None:
    folder = build_tiny_checkpoint(tmp_path / "bf16", "granite", **GRANITE, attention_bias=True)
    reshard(folder, 2, torch.bfloat16)
    assert_same_as_former_path(folder, torch.float32)  # widened through the staging buffer
    assert_same_as_former_path(folder, torch.bfloat16)  # read straight into the parameters
    f32 = build_tiny_checkpoint(tmp_path / "f32", "qwen2")
    assert_same_as_former_path(f32, torch.bfloat16)  # rounded as Hugging Face rounds


def to_bin(folder: Path, parts: int, dtype: torch.dtype | None = None) -> None:
    """Rewrite the checkpoint as pytorch_model.bin (parts > 1: shards with an index), tied tables included
    under both names, as torch.save writes a tied model's state dict; optionally in another dtype."""
    sd = {n: t if dtype is None else t.to(dtype) for n, t in load_file(folder / "model.safetensors").items()}
    (folder / "model.safetensors").unlink()
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("tie_word_embeddings"):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    if parts == 1:
        torch.save(sd, folder / "pytorch_model.bin")
        return
    names = sorted(sd)
    weight_map = {}
    for k in range(parts):
        shard = f"pytorch_model-{k + 1:05d}-of-{parts:05d}.bin"
        torch.save({n: sd[n] for n in names[k::parts]}, folder / shard)
        weight_map |= dict.fromkeys(names[k::parts], shard)
    (folder / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


@pytest.mark.parametrize("parts", [1, 2])
def test_pytorch_model_bin_loads_as_the_former_path(parts: int, tmp_path: Path) -> None:
    folder = build_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    to_bin(folder, parts)
    ours = assert_same_as_former_path(folder, torch.float32)
    # both tables in the file: loaded as two (Hugging Face ties them only where they are equal)
    assert not ours.spec.tie_embeddings


@pytest.mark.parametrize("disk", [torch.float32, torch.bfloat16])
def test_tensors_read_in_chunks_on_several_threads_load_as_the_former_path(
    disk: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chunks of a few KB split every tiny tensor into many preads across the reading threads, as a large
    # model's tensors are split; a float32 file is read straight into the parameters, a bfloat16 one
    # through the threads' staging buffers.
    monkeypatch.setattr(weights, "CHUNK_BYTES", 3 * 1024)
    folder = build_tiny_checkpoint(tmp_path, "granite", **GRANITE, attention_bias=True)
    reshard(folder, 2, disk)
    assert_same_as_former_path(folder, torch.float32)


RSS_CHILD = """
import gc, json, re, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig  # imported before the peak is reset
import transformers.models.llama.modeling_llama
from worker.models.loader import load_model

def status():
    text = Path("/proc/self/status").read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r"^(VmHWM|VmRSS):\\s+(\\d+) kB", text, re.M)}

out = []
for dtype in (torch.bfloat16, torch.float32):
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
    before = status()
    model = load_model(sys.argv[1], dtype, torch.device("cpu")).model
    after = status()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    out.append({"above": after["VmHWM"] - before["VmRSS"] - weights})
    del model
print(json.dumps(out))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_loading_holds_the_weights_and_less_than_a_tensor_more(fmt: str, tmp_path: Path) -> None:
    """Peak RSS of a load (its own: the child resets the peak first) above the final weights stays within
    the largest tensor + 10%: a whole shard mapped and copied out, or Hugging Face's copy beside ours,
    would add the checkpoint's size, three times the largest tensor here."""
    import subprocess
    import sys

    vocab, hidden = 131072, 256  # the two tables: 64 MiB each in bfloat16, 128 MiB served in float32
    folder = build_tiny_checkpoint(tmp_path, "llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=512,
                                   num_attention_heads=4, num_hidden_layers=2)  # fmt: skip
    if fmt == "bin":
        to_bin(folder, 1, torch.bfloat16)
    else:
        reshard(folder, 1, torch.bfloat16)
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", RSS_CHILD, str(folder)], cwd=root, capture_output=True,
                         text=True, check=True, timeout=300)  # fmt: skip
    bf16, f32 = json.loads(run.stdout.splitlines()[-1])
    largest = vocab * hidden * 2
    assert bf16["above"] <= 1.1 * largest, bf16  # straight into the parameters, or a mapped chunk at a time
    assert f32["above"] <= 1.1 * 2 * largest, f32  # widened through the staging buffers, or chunk by chunk
