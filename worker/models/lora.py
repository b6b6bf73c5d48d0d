"""LoRA adapters (PEFT's folders) over a native decoder, many in one batch.

An adapter is read once (`read_adapter`): its `adapter_config.json` and safetensors weights, each target
module mapped onto our linear that holds it (a fused q/k/v or gate/up projection takes its part's rows),
checked against the base model's shapes, and kept on the host as one pair per linear: A [ranks, in], the
parts' A matrices stacked, and B [out, ranks], each part's B times its scaling in its own rows and columns
(zeros elsewhere, so one shrink and one expand serve every part).

A linear that adapters may target holds a `LoraLayer`: up to `max_loras` slots, their pairs stacked for
the backend's grouped pass (Backend.lora_grouped: lora.c on a CPU, Triton's BGMV kernels on a GPU, each
row's sums in an order fixed by the shapes, so a row's delta never follows what else shares the step).
The step's rows name their slot in the model's `LoraStep` (-1: the base model); a linear adds B(A x) to
the rows of each slot present, after its base product, as PEFT does.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from worker.kernels.backend import TORCH_LORA, Backend, LoraGrouped

if TYPE_CHECKING:
    from worker.models.layers import Linear

PREFIX = "base_model.model."  # PEFT's names: the wrapped model's, under this prefix
# adapter_config.json settings that change what a LoRA computes beyond B(A x) * scaling: refused by name
REFUSED_SETTINGS = {
    "use_dora": "DoRA (use_dora) is not supported",
    "lora_bias": "LoRA biases (lora_bias) are not supported",
    "modules_to_save": "modules_to_save (whole trained modules beside the LoRA) is not supported",
    "trainable_token_indices": "trainable token embeddings are not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA is not supported",
    "use_bdlora": "BD-LoRA is not supported",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "adapters on parameters (target_parameters, MoE experts) are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers) is not supported",
    # PEFT's other LoRA variants, each of which changes what its layers compute
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
    "velora_config": "VeLoRA (velora_config) is not supported",
}


@dataclass(frozen=True)
class LoraTarget:
    """A module an adapter may target (Hugging Face's name): rows [start, stop) of our linear `name`
    (`layer`), whose output the model multiplies by `scale` (Granite's residual multiplier, folded into
    the base weight at load)."""

    name: str
    layer: Linear
    start: int
    stop: int
    scale: float = 1.0


class LoraError(ValueError):
    """An adapter that cannot run on this model: the message names the adapter and the reason."""


@dataclass
class LoraAdapter:
    """One adapter as read: per target linear (our name, e.g. "layers.0.self_attn.qkv_proj"), its host pair
    (A [ranks, in], B [out, ranks], the scalings folded into B)."""

    name: str
    path: Path
    rank: int  # the largest rank of its modules
    digest: str  # of its config and weights: what the result cache and the prefix cache key on
    pairs: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.pairs.values()
        )


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that ends the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(name: str, folder: Path) -> dict[str, Any]:
    path = folder / "adapter_config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoraError(
            f"adapter {name!r}: {folder} has no adapter_config.json (not a PEFT adapter)"
        ) from None
    except (OSError, ValueError) as e:
        raise LoraError(f"adapter {name!r}: {path} cannot be read: {e}") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"adapter {name!r}: {path} is not a JSON object")
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoraError(f"adapter {name!r}: peft_type {kind!r}; batchq serves LoRA adapters only")
    for key, why in REFUSED_SETTINGS.items():
        if cfg.get(key):
            raise LoraError(f"adapter {name!r}: {why}")
    if cfg.get("init_lora_weights") == "mica":  # a variant PEFT selects by its initialisation
        raise LoraError(f"adapter {name!r}: MiCA (init_lora_weights 'mica') is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"adapter {name!r}: bias {cfg['bias']!r} (trained biases) is not supported")
    return cfg


def _read_weights(name: str, folder: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        found = "adapter_model.bin (a pickle, which batchq does not load)" if (folder / "adapter_model.bin").exists() else "nothing"  # fmt: skip
        raise LoraError(f"adapter {name!r}: {folder} has no adapter_model.safetensors ({found})")
    try:
        return load_file(str(path))
    except Exception as e:  # a truncated or foreign file: safetensors' own error says which
        raise LoraError(f"adapter {name!r}: {path} cannot be read: {e}") from None


def same_base(named: str | None, served: list[str]) -> bool:
    """Whether an adapter's base_model_name_or_path names the model served (any of its names: the model
    as configured, the checkpoint's own _name_or_path): equal after the last path component, case aside.
    An adapter that names no base is taken on its shapes alone."""
    if not named:
        return True

    def key(s: str) -> str:
        return Path(s.rstrip("/")).name.lower().removesuffix(".gguf")

    return any(key(named) == key(s) for s in served if s)


def _pairs_by_module(name: str, weights: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """PEFT's tensors by module (Hugging Face's name): {"A": lora_A, "B": lora_B}."""
    out: dict[str, dict[str, Tensor]] = {}
    embedding = next((k for k in weights if "lora_embedding" in k), None)
    if embedding is not None:
        module = embedding.removeprefix(PREFIX).split(".lora_embedding")[0].rsplit(".", 1)[-1]
        raise LoraError(f"adapter {name!r}: a LoRA on {module} is not supported (attention and MLP only)")
    for key, t in weights.items():
        m = re.fullmatch(r"(.+)\.lora_(A|B)(?:\.[^.]+)?\.weight", key.removeprefix(PREFIX))
        if m is None:
            what = (
                "embedding LoRA" if "lora_embedding" in key else "a tensor that is not a LoRA A or B weight"
            )
            raise LoraError(f"adapter {name!r}: {key!r} is {what}; batchq adapts linear layers only")
        out.setdefault(m.group(1), {})[m.group(2)] = t
    for module, ab in out.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: module {module!r} has lora_{'A' if 'B' in ab else 'B'} only")
    return out


def _stacked(
    lin: Linear, parts: list[tuple[int, int, Tensor, Tensor]], dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """One linear's parts (rows start:stop, A, scaled B) as one pair: A [ranks, in] stacked, B [out, ranks]
    with each part's B in its rows and its own ranks' columns."""
    ranks = sum(a.shape[0] for _, _, a, _ in parts)
    a_cat, b_cat = torch.zeros(ranks, lin.in_features), torch.zeros(lin.out_features, ranks)
    at = 0
    for start, stop, a, b in parts:
        a_cat[at : at + a.shape[0]] = a
        b_cat[start:stop, at : at + a.shape[0]] = b
        at += a.shape[0]
    return a_cat.to(dtype), b_cat.to(dtype)


def read_adapter(
    name: str, folder: Path, targets: dict[str, LoraTarget], max_rank: int, base_names: list[str],
    dtype: torch.dtype,
) -> LoraAdapter:  # fmt: skip
    """Read and check the PEFT adapter in `folder`. targets: the modules adapters may target, by Hugging
    Face's name (LlamaFamilyModel.lora_targets); dtype: the compute dtype its pairs are kept in. Raises
    LoraError with one line naming the adapter and the reason."""
    cfg = _read_config(name, folder)
    if not same_base(cfg.get("base_model_name_or_path"), base_names):
        raise LoraError(f"adapter {name!r} was trained for base model {cfg['base_model_name_or_path']!r}, "
                        f"not {base_names[0]!r}")  # fmt: skip
    weights = _read_weights(name, folder)
    use_rs = bool(cfg.get("use_rslora", False))
    parts: dict[str, list[tuple[int, int, Tensor, Tensor]]] = {}
    rank = 0
    for module, ab in sorted(_pairs_by_module(name, weights).items()):
        short = module.rsplit(".", 1)[-1]
        if short in ("embed_tokens", "lm_head"):
            raise LoraError(f"adapter {name!r}: a LoRA on {short} is not supported (attention and MLP only)")
        target = targets.get(module)
        if target is None:
            raise LoraError(f"adapter {name!r}: target module {module!r} is not one batchq adapts (attention's "
                            "q/k/v/o and a dense MLP's gate/up/down projections; not a mixture's experts)")  # fmt: skip
        a, b = ab["A"].float(), ab["B"].float()
        r, lin, rows = a.shape[0], target.layer, target.stop - target.start
        if a.shape != (r, lin.in_features) or b.shape != (rows, r):
            raise LoraError(
                f"adapter {name!r}: module {module!r} has A {tuple(a.shape)} and B {tuple(b.shape)}, but the "
                f"base model's {short} takes {lin.in_features} inputs to {rows} outputs (an adapter for "
                "another base model?)"
            )
        if r > max_rank:
            raise LoraError(
                f"adapter {name!r}: module {module!r} has rank {r}, above max_lora_rank {max_rank}"
            )
        r_m = _pattern_value(cfg.get("rank_pattern") or {}, module, cfg.get("r", r))
        if r_m != r:
            raise LoraError(f"adapter {name!r}: module {module!r} has rank {r} but its config says {r_m}")
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module, cfg.get("lora_alpha", 8))
        scaling = alpha / (math.sqrt(r) if use_rs else r)
        # Granite's residual multiplier, folded into o / down weights at load, applies to their delta too
        parts.setdefault(target.name, []).append((target.start, target.stop, a, b * (scaling * target.scale)))
        rank = max(rank, r)
    if not parts:
        raise LoraError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    layers = {t.name: t.layer for t in targets.values()}
    pairs = {ours: _stacked(layers[ours], ps, dtype) for ours, ps in parts.items()}
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(cfg, sort_keys=True).encode())
    for key in sorted(weights):
        digest.update(key.encode() + weights[key].contiguous().view(torch.uint8).numpy().tobytes())
    return LoraAdapter(name, folder, rank, digest.hexdigest(), pairs)


@dataclass
class LoraStep:
    """The step's rows' adapter slots: `slots` [T] int32, each row's slot or -1 (the base model). None of
    it: a step of base rows only."""

    slots: Tensor

    @classmethod
    def of(cls, row_slots: list[int], device: torch.device) -> LoraStep | None:
        if not any(s >= 0 for s in row_slots):
            return None
        return cls(torch.tensor(row_slots, dtype=torch.int32, device=device))


class LoraState:
    """What every LoraLayer of a model shares: the step being run (None: base rows only)."""

    def __init__(self) -> None:
        self.step: LoraStep | None = None


class LoraLayer:
    """A linear's adapter slots: each slot's (A, B), stacked A [slots, R, in] and B [slots, out, R] (R: the
    widest pair's ranks, zero-padded; B [slots, R, out] where the pass takes it transposed) for the
    backend's grouped pass (lora.c on a CPU, Triton on a GPU, else torch's ops)."""

    def __init__(self, base: Linear, state: LoraState, max_loras: int, max_width: int) -> None:
        """max_width: the most ranks an adapter's pair may have here (max_lora_rank per part it targets)."""
        self.base, self.state, self.max_width = base, state, max_width
        self.raw: list[tuple[Tensor, Tensor] | None] = [None] * max_loras  # (A, B) of each slot
        self.a_stack: Tensor | None = None
        self.b_stack: Tensor | None = None
        self.grouped: LoraGrouped = TORCH_LORA

    def install(self, slot: int, pair: tuple[Tensor, Tensor] | None, backend: Backend) -> None:
        """Put an adapter's pair for this linear in `slot` (None: the adapter leaves this linear alone), and
        stack the slots for the backend's grouped pass (torch's where its kernel did not build)."""
        self.grouped = backend.lora_grouped if backend.lora_grouped.available() else TORCH_LORA
        device = self.base.weight.device
        self.raw[slot] = None if pair is None else (pair[0].to(device), pair[1].to(device))
        self._stack()

    def _stack(self) -> None:
        """The slots' pairs stacked, zero-padded to one width: the widest resident pair's, or, where the
        grouped pass's sums follow that width (Triton's tiles over the ranks), the most any adapter may
        have, so that a row's numbers never follow which adapters are resident."""
        present = [p for p in self.raw if p is not None]
        if not present:
            self.a_stack = self.b_stack = None
            return
        width = self.max_width if self.grouped.fixed_width else max(a.shape[0] for a, _ in present)
        like = present[0][0]
        a = torch.zeros(len(self.raw), width, self.base.in_features, dtype=like.dtype, device=like.device)
        b = torch.zeros(len(self.raw), self.base.out_features, width, dtype=like.dtype, device=like.device)
        for i, p in enumerate(self.raw):
            if p is not None:
                a[i, : p[0].shape[0]] = p[0]
                b[i, :, : p[1].shape[1]] = p[1]
        self.a_stack, self.b_stack = a, b.transpose(1, 2).contiguous() if self.grouped.b_transposed else b

    def add(self, x: Tensor, y: Tensor) -> Tensor:
        """y (the base product of x) plus each row's adapter's B(A x)."""
        step = self.state.step
        if step is None:
            return y
        if self.a_stack is not None and self.b_stack is not None:
            self.grouped.run(x, y, self.a_stack, self.b_stack, step.slots)
        return y


def lora_targets(model: Any) -> dict[str, LoraTarget]:
    """The modules a LoRA adapter may target in a native decoder (LlamaFamilyModel), by Hugging Face's
    name: attention's projections and a dense MLP's (each part of a fused one, and the fused one itself, as
    Phi-3 names it). Not the embedding or LM head, nor a mixture's experts."""
    from worker.models.mlp import MLP

    s, out = model.spec, {}
    q, kv, r = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.residual_multiplier
    for i, layer in enumerate(model.layers):
        a, pre = layer.self_attn, f"model.layers.{i}."
        fused: list[tuple[str, Linear, list[tuple[str, int, int]], float]] = [
            ("self_attn.qkv_proj", a.qkv_proj, [("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)], 1.0),
            ("self_attn.o_proj", a.o_proj, [], r),
        ]  # fmt: skip
        if isinstance(layer.mlp, MLP):
            half = layer.mlp.gate_up_proj.out_features // 2
            fused += [("mlp.gate_up_proj", layer.mlp.gate_up_proj, [("gate_proj", 0, half), ("up_proj", half, 2 * half)], 1.0),
                      ("mlp.down_proj", layer.mlp.down_proj, [], r)]  # fmt: skip
        for name, lin, parts, scale in fused:
            ours = f"layers.{i}.{name}"
            out[pre + name] = LoraTarget(ours, lin, 0, lin.out_features, scale)
            for part, start, stop in parts:
                out[pre + name.rsplit(".", 1)[0] + "." + part] = LoraTarget(ours, lin, start, stop, scale)
    return out


def enable_lora(model: Any, max_loras: int, max_rank: int) -> tuple[LoraState, dict[str, LoraTarget]]:
    """Slots for `max_loras` adapters on every linear an adapter may target in `model` (a native decoder,
    whose forward skips the C decode stack while a step has adapter rows). -> the state its LoraLayers
    share (model.lora), and lora_targets(model)."""
    if model.tp is not None:
        raise LoraError("LoRA adapters under tensor parallelism are not supported yet: use "
                        "tensor_parallel_size = 1 (data_parallel_size scales out)")  # fmt: skip
    model.lora = state = LoraState()
    targets = lora_targets(model)
    parts: dict[str, int] = {}  # the parts an adapter may target in each linear (q, k, v: 3)
    for t in targets.values():
        whole = (t.start, t.stop) == (0, t.layer.out_features)
        parts[t.name] = parts.get(t.name, 0) + (0 if whole else 1)
    for t in targets.values():
        if t.layer.lora is None:
            t.layer.lora = LoraLayer(t.layer, state, max_loras, max_rank * max(1, parts[t.name]))
    return state, targets
