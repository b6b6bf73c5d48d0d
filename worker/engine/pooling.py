"""Embedding requests' vectors: which pooling the model asks for, and the pooling of a step's hidden states.

The hidden states pooled are the model's output after its final norm (what Hugging Face's
`last_hidden_state` is). A vector is pooled, cut to `dimensions` (Matryoshka models put the most
information first), then L2-normalised, as sentence-transformers and vLLM do.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from worker.engine.sequence import Sequence
from worker.engine_config import Pooling

log = logging.getLogger(__name__)

# sentence-transformers' 1_Pooling/config.json keys, and the pooling each names
_ST_MODES: dict[str, Pooling | None] = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": None,
    "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}


@dataclass(frozen=True)
class ModelPooling:
    """The pooling embedding requests get, or why this model cannot embed (`refused`)."""

    pooling: Pooling | None
    source: str  # where it came from, for the load log
    refused: str = ""


def model_pooling(checkpoint_dir: str, setting: str) -> ModelPooling:
    """`setting`: EngineConfig.embedding_pooling. auto reads a sentence-transformers config when the checkpoint
    has one (modules.json naming a Pooling module), else takes the last token: a decoder's last position is
    the only one that has seen the whole input, which is how Qwen3-Embedding-style models are trained."""
    if setting in ("last", "mean"):
        return ModelPooling(setting, "embedding_pooling")  # type: ignore[arg-type]
    modules_file = Path(checkpoint_dir) / "modules.json"
    if not modules_file.is_file():
        return ModelPooling("last", "the default for decoder models")
    try:
        modules: list[dict[str, Any]] = json.loads(modules_file.read_text())
        pool = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
        if pool is None:
            return ModelPooling("last", f"{modules_file} names no Pooling module")
        config_file = Path(checkpoint_dir) / str(pool.get("path", "")) / "config.json"
        config = json.loads(config_file.read_text())
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        return ModelPooling(None, str(modules_file), f"its sentence-transformers config is unreadable: {exc}")
    after = [str(m.get("type")) for m in modules[modules.index(pool) + 1 :]]
    extra = [t for t in after if not t.endswith(".Normalize")]
    if extra:
        return ModelPooling(
            None, str(modules_file), f"modules after pooling that batchq does not run: {extra}"
        )
    modes = [k for k, v in config.items() if k in _ST_MODES and v is True]
    if len(modes) != 1 or _ST_MODES[modes[0]] is None:
        return ModelPooling(
            None, str(config_file),
            f"its pooling {modes or 'none'} is not one batchq computes (last token, mean); set embedding_pooling",
        )  # fmt: skip
    return ModelPooling(_ST_MODES[modes[0]], str(config_file))


@dataclass(frozen=True)
class PoolRows:
    """One embedding input's prompt chunk in a step: the batch's sequence `index`, its rows in the packed
    hidden states, and whether the chunk ends its input (its vector is then complete)."""

    index: int
    start: int
    length: int
    last: bool


def pool(hidden: Tensor, seqs: list[Sequence], rows: list[PoolRows]) -> dict[int, list[float]]:
    """The vectors of the inputs whose last chunk this step computed, by batch index. Mean pooling adds
    every chunk's rows to the sequence's running sum (a long input is computed over several steps)."""
    # hidden: [T, hidden_size]
    done: list[tuple[int, Tensor, int | None]] = []
    for r in rows:
        seq = seqs[r.index]
        if seq.pooling == "mean":
            part = hidden[r.start : r.start + r.length].float().sum(0)
            seq.pooled = part if seq.pooled is None else seq.pooled + part
            if r.last:
                done.append((r.index, seq.pooled / seq.prompt_len, seq.dimensions))
        elif r.last:
            done.append((r.index, hidden[r.start + r.length - 1].float(), seq.dimensions))
    out: dict[int, list[float]] = {}
    by_dims: dict[int | None, list[tuple[int, Tensor]]] = {}
    for index, vec, dims in done:
        by_dims.setdefault(dims, []).append((index, vec))
    for dims, group in by_dims.items():
        vecs = torch.stack([v for _, v in group])[:, :dims]  # [n, d]
        unit = torch.nn.functional.normalize(vecs, dim=-1).tolist()
        out.update({index: u for (index, _), u in zip(group, unit, strict=True)})
    return out
