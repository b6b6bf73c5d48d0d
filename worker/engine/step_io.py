"""A step's inputs on their way to the device and a launched decode step's tokens on their way back.

Async scheduling (overlap.py) launches a decode step while the one before it runs. On CUDA a pageable
copy, or a .tolist() of a device tensor, waits for everything queued on the stream: the step just
launched included, which would undo the overlap. So a decode step's inputs go to the device from pinned
memory without waiting, and its sampled ids come back into pinned memory behind an event, which the
engine waits for alone (DecodeDone.token_list).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from worker.models.layers import AttentionMetadata


@dataclass
class StepInputs:
    """One forward pass's packed inputs, whatever the phase."""

    input_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64
    meta: AttentionMetadata
    logits_index: Tensor  # [S]: the row in T of the last token of each sequence sampled from
    sampled: list[int]  # [S]: which of the batch's sequences those are (a prompt chunk that does not
    # finish its prompt is not sampled from)
    every_row: bool = False  # logits_index is every row of T in order (a decode step): no gather needed


def upload(host: Tensor, device: torch.device) -> Tensor:
    """A CPU tensor on `device`: on CUDA from pinned memory, queued on the stream without waiting for it
    (the caching host allocator keeps the pinned block until the copy has run)."""
    if device.type == "cpu":
        return host
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def decode_to_device(step: StepInputs, device: torch.device) -> StepInputs:
    """A decode step's inputs built on the host (ModelRunner.decode_inputs), on `device` in two copies."""
    if device.type == "cpu":
        return step
    m = step.meta
    n = step.input_ids.shape[0]
    ints = upload(torch.cat([step.input_ids, step.positions, m.slot_mapping, m.context_lens.long()]), device)
    input_ids, positions, slots, context = ints.view(4, n)
    meta = AttentionMetadata(
        phase="decode",
        slot_mapping=slots,
        block_tables=upload(m.block_tables, device),
        context_lens=context.to(torch.int32),
    )
    index = torch.arange(n, device=device)
    return StepInputs(input_ids, positions, meta, index, step.sampled, every_row=True)


@dataclass
class DecodeDone:
    """A launched decode step's result (ModelRunner.launch_decode): its sampled token ids [B] on the device
    (the next step's input ids), the seconds its work took on the device thread and, on CUDA, a pinned copy
    of the ids complete once `ready` has passed."""

    tokens: Tensor
    seconds: float
    host: Tensor | None = None
    ready: Any = None  # torch.cuda.Event

    @classmethod
    def of(cls, tokens: Tensor, seconds: float) -> DecodeDone:
        """On CUDA, the ids' copy to the host is queued here, on the device thread, behind the sampler."""
        if tokens.device.type != "cuda":
            return cls(tokens, seconds)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
        return cls(tokens, seconds, host, ready)

    def token_list(self) -> list[int]:
        """The sampled ids, waiting for this step's copy only (not for a step launched behind it)."""
        if self.ready is None or self.host is None:
            return self.tokens.tolist()
        self.ready.synchronize()
        return self.host.tolist()
