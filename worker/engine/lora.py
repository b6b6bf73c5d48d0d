"""The engine's LoRA adapters: which names it serves (EngineConfig.lora, lora_dir), the adapters read (on the
host, checked at read: models/lora.py), and `max_loras` slots on the model, each an adapter's weights in
every linear it targets. A running sequence holds its adapter's slot (Scheduler admission); a slot no
sequence holds goes to the next adapter asked for, the least recently used first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from worker.engine.request import EngineRequest, RequestError
from worker.engine.sequence import Sequence
from worker.engine_config import EngineConfig
from worker.kernels.backend import Backend
from worker.models.errors import ModelLoadError
from worker.models.loader import LoadedModel
from worker.models.lora import LoraAdapter, LoraError, LoraLayer, LoraStep, enable_lora, read_adapter

log = logging.getLogger(__name__)

MODEL_NOT_FOUND = "model_not_found"
# adapters read from lora_dir and kept on the host beyond those in slots (each is read again when it returns)
HOST_SPARE = 8


class LoraManager:
    """`model`: the native decoder (LlamaFamilyModel); `backend`: the engine's kernels (each slot's pairs
    run the base linears' method, or the backend's grouped pass); base_names: the served model's names,
    which an adapter's base_model_name_or_path must match."""

    def __init__(self, cfg: EngineConfig, model: Any, backend: Backend, base_names: list[str]) -> None:
        self.cfg, self.model, self.backend = cfg, model, backend
        self.base_names = base_names
        self.state, self.targets = enable_lora(model, cfg.max_loras, cfg.max_lora_rank)
        self.layers = {t.name: t.layer for t in self.targets.values()}
        self.paths = {name: Path(path) for name, path in cfg.lora.items()}
        self.adapters: dict[str, LoraAdapter] = {}
        self.names: list[str | None] = [None] * cfg.max_loras  # the adapter in each slot
        self.holders = [0] * cfg.max_loras  # sequences holding each slot
        self.idle: OrderedDict[int, None] = OrderedDict.fromkeys(range(cfg.max_loras))  # unheld, LRU first
        for name in self.paths:  # a bad adapter given by name is refused at load, naming it
            self.read(name)
        if self.paths:
            log.info("LoRA adapters: %s (max_loras %d, max_lora_rank %d)",
                     ", ".join(f"{n} (rank {a.rank})" for n, a in self.adapters.items()),
                     cfg.max_loras, cfg.max_lora_rank)  # fmt: skip

    def folder(self, name: str) -> Path | None:
        """Where the adapter `name` lies, or None where this engine serves no such adapter."""
        if name in self.paths:
            return self.paths[name]
        if self.cfg.lora_dir is not None and "/" not in name and name not in ("", ".", ".."):
            found = Path(self.cfg.lora_dir) / name
            if (found / "adapter_config.json").is_file():
                return found
        return None

    def serves(self, name: str) -> bool:
        return self.folder(name) is not None

    def read(self, name: str) -> LoraAdapter:
        """The adapter read and checked (once; a lora_dir adapter again after it left the host)."""
        adapter = self.adapters.get(name)
        if adapter is not None:
            return adapter
        folder = self.folder(name)
        if folder is None:
            raise KeyError(name)
        adapter = read_adapter(name, folder, self.targets, self.cfg.max_lora_rank, self.base_names,
                               self.model.dtype)  # fmt: skip
        self.adapters[name] = adapter
        spare = [n for n in self.adapters if n not in self.paths and n not in self.names]
        for n in spare[: max(0, len(spare) - HOST_SPARE)]:
            self.adapters.pop(n, None)  # (the queue's thread reads adapters too, for their digests)
        return adapter

    def resolve(self, req: EngineRequest, seqs: Iterable[Sequence]) -> None:
        """Name the request's adapter on its sequences; RequestError where it is unknown or cannot run."""
        if req.lora is None:
            return
        try:
            adapter = self.read(req.lora)
        except KeyError:
            raise RequestError(MODEL_NOT_FOUND, f"no LoRA adapter {req.lora!r} is served here") from None
        except LoraError as e:
            raise RequestError("invalid_request", str(e)) from None
        for s in seqs:
            s.lora, s.lora_digest = adapter.name, adapter.digest

    def digest(self, name: str) -> str | None:
        """The adapter's content digest (it is read where it was not), or None where it cannot be."""
        try:
            return self.read(name).digest
        except (KeyError, LoraError):
            return None

    def resident(self) -> list[str]:
        return [n for n in self.names if n is not None]

    # ---- slots (Scheduler.AdapterSlots) ----

    def acquire(self, name: str) -> int | None:
        if name in self.names:
            slot = self.names.index(name)
        elif self.idle:
            slot = next(iter(self.idle))
            adapter = self.read(name)
            for ours, layer in self.layers.items():
                assert isinstance(layer.lora, LoraLayer)
                layer.lora.install(slot, adapter.pairs.get(ours), self.backend)
            log.info("LoRA adapter %s in slot %d%s", name, slot,
                     f" (was {self.names[slot]})" if self.names[slot] else "")  # fmt: skip
            self.names[slot] = name
        else:
            return None
        self.hold(slot)
        return slot

    def hold(self, slot: int) -> None:
        self.holders[slot] += 1
        self.idle.pop(slot, None)

    def release(self, slot: int) -> None:
        self.holders[slot] -= 1
        if self.holders[slot] == 0:
            self.idle[slot] = None  # most recently used last

    def step_of(
        self, seqs: list[Sequence], counts: list[int] | None, device: torch.device
    ) -> LoraStep | None:
        """Each row's adapter slot for a step of `seqs`, `counts` rows each (default one); None where no
        sequence has an adapter."""
        if not any(s.lora_slot >= 0 for s in seqs):
            return None
        if counts is None:
            return LoraStep.of([s.lora_slot for s in seqs], device)
        return LoraStep.of([s.lora_slot for s, n in zip(seqs, counts, strict=True) for _ in range(n)], device)

    def set_step(self, step: LoraStep | None) -> None:
        """The adapters of the model's next forward pass."""
        self.state.step = step


def lora_manager(cfg: EngineConfig, loaded: LoadedModel, backend: Backend) -> LoraManager | None:
    """The engine's adapters, where its config names any (None otherwise). ModelLoadError where they cannot
    be served: one names the adapter and the reason."""
    if not cfg.lora and cfg.lora_dir is None:
        return None
    if loaded.implementation != "native":
        raise ModelLoadError(f"model {cfg.model!r} runs on the transformers fallback: LoRA adapters need "
                             "batchq's native decoder (model_impl = 'native' families)")  # fmt: skip
    if cfg.lora_dir is not None and not Path(cfg.lora_dir).is_dir():
        raise ModelLoadError(f"lora_dir {cfg.lora_dir!r} is not a folder")
    names = [
        cfg.model,
        loaded.name,
        str(loaded.checkpoint_dir),
        getattr(loaded.hf_config, "_name_or_path", ""),
    ]
    try:
        return LoraManager(cfg, loaded.model, backend, names)
    except LoraError as e:
        raise ModelLoadError(str(e)) from None


def adapters(loras: LoraManager | None, req: EngineRequest, seqs: Iterable[Sequence]) -> None:
    """Name the request's adapter (req.lora) on its sequences; RequestError where it is not served."""
    if loras is None:
        raise RequestError(MODEL_NOT_FOUND, f"no LoRA adapter {req.lora!r} is served here (no adapters are)")
    loras.resolve(req, seqs)
