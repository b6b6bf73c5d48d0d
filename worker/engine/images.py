"""The engine's image requests (a vision-language model: models/vision.py). A request's images are decoded
and processed on CPU threads as soon as it is added, so steps never wait on image decoding; the request
joins the engine once they are ready. Its prompt's placeholders are expanded to each image's tokens, its
tokens' M-RoPE positions computed, and the prefix cache hashes its image tokens by the image's content.
The tower encodes a sequence's images when its prefill starts (each image alone: an image's embeddings
never depend on what else is encoded), and each step places them at their tokens (`StepImages`).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from worker.engine.request import EngineRequest, RequestError
from worker.engine.sequence import Sequence
from worker.models.vision import ImageError, PreparedImages, VisionTower

PREP_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))  # image decoding beside the engine's own threads


@dataclass
class SeqImages:
    """A sequence's images: processed (`prepared`), encoded once its prefill starts (`embeds`, [tokens,
    hidden]), each prompt token's M-RoPE positions [3, len] and later tokens' `delta`, and each prompt
    token's row in `embeds` (-1: not an image's)."""

    prepared: PreparedImages
    positions: Tensor | None  # None: a decoder of one position per token (LLaVA)
    delta: int
    feature_row: Tensor
    embeds: Tensor | None = None


class Images:
    def __init__(self, tower: VisionTower) -> None:
        self.tower = tower
        self._pool = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="batchq-images")
        # each request's decoding, keyed by the request object itself (ids may repeat: a refused duplicate
        # must not take another request's images); a request moves to _ready once decoded, for the intake
        # that admits it, and what that intake refused is dropped at the next
        self._prep: dict[int, tuple[EngineRequest, Future[PreparedImages]]] = {}
        self._ready: dict[int, tuple[EngineRequest, Future[PreparedImages]]] = {}
        # seconds spent decoding and processing images (summed over the threads) and in the tower
        self.prepare_s = self.encode_s = 0.0

    def start(self, req: EngineRequest) -> None:
        """Begin decoding the request's images (thread-safe: called where the request is added)."""
        if req.images:
            self._prep[id(req)] = (req, self._pool.submit(self._prepare, req.images))

    def _prepare(self, images: list[bytes]) -> PreparedImages:
        t0 = time.perf_counter()
        try:
            return self.tower.prepare(images)
        finally:
            self.prepare_s += time.perf_counter() - t0  # (a float add: no lock needed for a statistic)

    def split(
        self, pending: list[tuple[EngineRequest, float]], cancelled: set[str]
    ) -> tuple[list[tuple[EngineRequest, float]], list[tuple[EngineRequest, float]]]:
        """The requests that may join the engine now (no images, images decoded, or cancelled: their
        decoding is dropped), and those whose images are still being decoded."""
        self._ready.clear()  # the requests of the intake before that were not admitted
        ready: list[tuple[EngineRequest, float]] = []
        waiting: list[tuple[EngineRequest, float]] = []
        for item in pending:
            entry = self._prep.get(id(item[0]))
            if entry is not None and item[0].request_id in cancelled:
                self._prep.pop(id(item[0]))[1].cancel()
            elif entry is not None and not entry[1].done():
                waiting.append(item)
                continue
            elif entry is not None:
                self._ready[id(item[0])] = self._prep.pop(id(item[0]))
            ready.append(item)
        return ready, waiting

    def expand(self, req: EngineRequest, ids: list[int]) -> tuple[list[int], PreparedImages]:
        """The prompt with its images' tokens in place of their placeholders; RequestError where an image
        cannot be taken or the placeholders do not pair with the images."""
        owner, fut = self._ready.pop(id(req))
        assert owner is req
        try:
            prepared = fut.result()
            return self.tower.expand(ids, prepared.tokens), prepared
        except ImageError as e:
            raise RequestError("invalid_request", str(e)) from None

    def attach(self, seq: Sequence, prepared: PreparedImages) -> None:
        """The sequence's SeqImages and its prompt as the prefix cache hashes it."""
        ids = seq.prompt_ids
        positions, delta = self.tower.mrope_positions(ids, prepared.grids) if self.tower.mrope else (None, 0)
        image = torch.tensor(ids) == self.tower.image_token_id
        feature_row = torch.full((len(ids),), -1, dtype=torch.int64)
        feature_row[image] = torch.arange(int(image.sum()))
        seq.vision = SeqImages(prepared, positions, delta, feature_row)
        hashed, k, which = list(ids), 0, 0
        bounds = [sum(prepared.tokens[: i + 1]) for i in range(len(prepared.tokens))]
        for i, t in enumerate(ids):
            if t == self.tower.image_token_id:
                while k >= bounds[which]:
                    which += 1
                # negative: never a real token id; the image's digest and the token's place in it
                hashed[i] = -1 - ((int(prepared.digests[which][:15], 16) + k) & ((1 << 62) - 1))
                k += 1
        seq.hash_ids = hashed

    def encode(self, seq: Sequence) -> Tensor:
        vision: SeqImages = seq.vision
        if vision.embeds is None:
            t0 = time.perf_counter()
            vision.embeds = torch.cat(self.tower.encode(vision.prepared))
            self.encode_s += time.perf_counter() - t0
        return vision.embeds


@dataclass
class StepImages:
    """A step's positions ([3, T] under M-RoPE) and the (rows, embeddings) of its images' tokens (None where
    no image token is computed)."""

    positions: Tensor
    injected: tuple[Tensor, Tensor] | None


def step_images(
    images: Images, seqs: list[Sequence], counts: list[int] | None, positions: Tensor
) -> StepImages | None:
    """For a step of `seqs` (`counts` rows each, default one, over 1-D `positions`): each row's three
    positions (an image sequence's prompt rows from its table, later rows at position + delta; every other
    row's three the same), and the image embeddings at their rows. None where no sequence has images."""
    if not any(s.vision is not None for s in seqs):
        return None
    counts = counts or [1] * len(seqs)
    pos = positions.cpu()
    three = pos.expand(3, -1).clone() if images.tower.mrope else None
    rows: list[Tensor] = []
    values: list[Tensor] = []
    at = 0
    for seq, n in zip(seqs, counts, strict=True):
        vision: SeqImages | None = seq.vision
        if vision is not None:
            p = pos[at : at + n]
            prompt = p < vision.feature_row.shape[0]
            inside = p.clamp(max=vision.feature_row.shape[0] - 1)
            if three is not None and vision.positions is not None:
                three[:, at : at + n] = torch.where(prompt, vision.positions[:, inside], p + vision.delta)
            feature = torch.where(prompt, vision.feature_row[inside], -1)
            hit = (feature >= 0).nonzero().flatten()
            if hit.numel():
                rows.append(hit + at)
                values.append(images.encode(seq)[feature[hit]])
        at += n
    device = positions.device
    injected = None
    if rows:
        injected = (torch.cat(rows).to(device), torch.cat(values).to(device))
    return StepImages(positions if three is None else three.to(device), injected)
