"""What a step sets on the model beyond its tokens and positions: each row's LoRA adapter (engine/lora.py),
and, for a vision-language model, its images' embeddings at their tokens with every row's M-RoPE positions
(engine/images.py). Built where the step's inputs are, applied on the thread that runs the step (an
overlapped decode step runs on the device thread, after the step before it set its own)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from worker.engine.images import Images, StepImages, step_images
from worker.engine.scheduler import ScheduledBatch
from worker.engine.sequence import Sequence
from worker.models.lora import LoraStep

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from worker.engine.lora import LoraManager


@dataclass
class StepExtras:
    loras: LoraManager | None
    lora: LoraStep | None
    images: StepImages | None

    def positions(self, flat: Tensor) -> Tensor:
        """The step's positions for the model: [3, T] where images set M-RoPE's, else `flat`."""
        return flat if self.images is None else self.images.positions

    def apply(self, model: Any) -> None:
        if self.loras is not None:
            self.loras.set_step(self.lora)
        if hasattr(model, "injected"):
            model.injected = None if self.images is None else self.images.injected


def step_extras(
    loras: LoraManager | None,
    images: Images | None,
    seqs: list[Sequence],
    counts: list[int] | None,
    positions: Tensor,
    device: torch.device,
) -> StepExtras:
    """For a step of `seqs`, `counts` rows each (default one), at 1-D `positions`."""
    lora = None if loras is None else loras.step_of(seqs, counts, device)
    vision = None if images is None else step_images(images, seqs, counts, positions)
    return StepExtras(loras, lora, vision)


def batch_rows(batch: ScheduledBatch) -> list[int] | None:
    """The rows of each of a step's sequences (ModelRunner.step_inputs packs them so): one per decoding
    sequence, then each prompt chunk's tokens. None: one each (a decode step)."""
    if batch.phase == "decode":
        return None
    chunks = batch.chunk_lens()
    return [1] * (len(batch.seqs) - len(chunks)) + chunks


def serve_extras(runner: Any, scheduler: Any, loras: LoraManager | None, images: Images | None) -> bool:
    """The engine's adapters and images, handed to its runner and scheduler; -> whether it takes images.
    CUDA graphs hold the base model's kernels and one position per token: an engine serving adapters or
    images runs its steps eagerly."""
    runner.loras, runner.images, scheduler.loras = loras, images, loras
    if (loras is not None or images is not None) and runner.graphs is not None:
        log.info("CUDA graphs off: steps with LoRA adapters or images run eagerly")
        runner.graphs = None
    return images is not None
