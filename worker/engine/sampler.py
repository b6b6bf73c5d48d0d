"""Vectorised sampling over the batch: greedy, temperature, top-k, top-p, min-p, and the logit
adjustments before them, in this order: logit_bias (OpenAI), repetition_penalty (HF/vLLM), then
presence_penalty and frequency_penalty (OpenAI: logit[t] -= presence x [t generated] + frequency x
count(t generated), over the generated tokens only).

Randomness is counter-based: each row's uniform is splitmix64(seed, step), so a seeded request samples
the same tokens whatever else is in the batch. One uniform per row, inverse-CDF over the filtered,
sorted distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1


def splitmix64_uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) determined by (seed, step) alone."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * (1.0 / (1 << 53))


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step, built by the runner from the sequences."""

    temperatures: list[float]
    top_ks: list[int]  # 0 = off
    top_ps: list[float]  # 1.0 = off
    min_ps: list[float]  # 0.0 = off
    repetition_penalties: list[float]  # 1.0 = off
    seen_token_ids: list[list[int]]  # prompt + generated ids, used only for rows with a penalty
    seeds: list[int]
    steps: list[int]  # tokens generated so far per row: the counter of the RNG
    presence_penalties: list[float] | None = None  # 0.0 = off; None: every row off
    frequency_penalties: list[float] | None = None
    output_token_ids: list[list[int]] | None = None  # generated ids, for rows with either of the two
    logit_biases: list[tuple[tuple[int, float], ...]] | None = None  # () = off
    # every row greedy, unbiased, unpenalised (the builder knows it without another pass): one argmax
    plain_greedy: bool = False


class Sampler:
    def __call__(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        # logits: [B, vocab] float32 -> token ids: [B] int64
        if batch.plain_greedy:
            return logits.argmax(dim=-1)
        logits = _apply_logit_bias(logits, batch)
        logits = self._apply_repetition_penalty(logits, batch)
        logits = _apply_openai_penalties(logits, batch)
        num_greedy = batch.temperatures.count(0.0)
        if num_greedy == len(batch.temperatures):
            return logits.argmax(dim=-1)
        dev = logits.device
        temps = torch.tensor([t if t > 0.0 else 1.0 for t in batch.temperatures], device=dev)
        sampled = self._sample(logits / temps.unsqueeze(1), batch)
        if num_greedy == 0:  # (an argmax is a pass over the vocabulary per row: none where none is greedy)
            return sampled
        greedy_rows = torch.tensor([t == 0.0 for t in batch.temperatures], device=dev)
        return torch.where(greedy_rows, logits.argmax(dim=-1), sampled)

    @staticmethod
    def _apply_repetition_penalty(logits: Tensor, batch: SamplingBatch) -> Tensor:
        if batch.repetition_penalties.count(1.0) == len(batch.repetition_penalties):
            return logits
        rows = [i for i, p in enumerate(batch.repetition_penalties) if p != 1.0]
        if not rows:
            return logits
        logits = logits.clone()
        width = max(len(batch.seen_token_ids[i]) for i in rows)
        # Pad with each row's own first id: a duplicate index writes the same value twice.
        ids = torch.tensor(
            [
                batch.seen_token_ids[i]
                + [batch.seen_token_ids[i][0]] * (width - len(batch.seen_token_ids[i]))
                for i in rows
            ],
            device=logits.device,
        )  # [R, width]
        pen = torch.tensor([batch.repetition_penalties[i] for i in rows], device=logits.device).unsqueeze(1)
        row_idx = torch.tensor(rows, device=logits.device)
        sub = logits[row_idx]  # [R, vocab]
        score = sub.gather(1, ids)
        score = torch.where(score < 0, score * pen, score / pen)  # HF semantics
        logits[row_idx] = sub.scatter(1, ids, score)
        return logits

    @staticmethod
    def _sample(logits: Tensor, batch: SamplingBatch) -> Tensor:
        # logits: [B, vocab] (temperature applied) -> [B]
        # Each row's path depends only on its own params (batch-invariant): rows with top-k / top-p
        # sort their distribution; the rest sample the unsorted one, skipping a costly vocab sort.
        dev = logits.device
        out = torch.zeros(logits.shape[0], dtype=torch.long, device=dev)
        u_all = [splitmix64_uniform(s, n) for s, n in zip(batch.seeds, batch.steps, strict=True)]
        sort_rows = [i for i in range(len(u_all)) if batch.top_ks[i] > 0 or batch.top_ps[i] < 1.0]
        sorted_set = set(sort_rows)
        plain_rows = [i for i in range(len(u_all)) if i not in sorted_set]
        for rows, sort in ((sort_rows, True), (plain_rows, False)):
            if not rows:
                continue
            idx = torch.tensor(rows, device=dev)
            sub = logits if len(rows) == logits.shape[0] else logits[idx]  # [R, vocab]
            order: Tensor | None = None
            if sort:
                sub, order = sub.sort(dim=-1, descending=True)
            probs = torch.softmax(_mask_top_k(sub, [batch.top_ks[i] for i in rows], sort), dim=-1)
            min_ps = [batch.min_ps[i] for i in rows]
            if sort or min_ps.count(0.0) != len(rows):
                keep_first = probs.argmax(dim=-1, keepdim=True)  # the top token always survives
                drop = torch.zeros_like(probs, dtype=torch.bool)
                if sort:  # nucleus: keep the smallest prefix whose mass reaches top_p
                    top_p = torch.tensor([batch.top_ps[i] for i in rows], device=dev, dtype=probs.dtype)
                    drop |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
                min_p = torch.tensor(min_ps, device=dev, dtype=probs.dtype).unsqueeze(1)
                drop |= probs < min_p * probs.max(dim=-1, keepdim=True).values
                drop.scatter_(1, keep_first, False)
                probs = probs.masked_fill(drop, 0.0)
            # (rows of temperature alone drop nothing: no probability is below 0 x the largest)
            cdf = probs.cumsum(dim=-1)  # [R, vocab]
            u = torch.tensor([u_all[i] for i in rows], device=dev, dtype=cdf.dtype).unsqueeze(1)
            pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=cdf.shape[1] - 1)
            tokens = pick if order is None else order.gather(1, pick)
            out[idx] = tokens.squeeze(1)
        return out


def _mask_top_k(sorted_or_raw: Tensor, top_ks: list[int], is_sorted: bool) -> Tensor:
    # [R, vocab] -> [R, vocab] with ranks >= k set to -inf (only meaningful on sorted rows)
    if not is_sorted or not any(k > 0 for k in top_ks):
        return sorted_or_raw
    vocab = sorted_or_raw.shape[1]
    ranks = torch.arange(vocab, device=sorted_or_raw.device).unsqueeze(0)
    k = torch.tensor([k if k > 0 else vocab for k in top_ks], device=sorted_or_raw.device).unsqueeze(1)
    return sorted_or_raw.masked_fill(ranks >= k, float("-inf"))


def _apply_logit_bias(logits: Tensor, batch: SamplingBatch) -> Tensor:
    biases = batch.logit_biases
    if not biases or not any(biases):
        return logits
    rows = [i for i, b in enumerate(biases) if b]
    if not rows or biases is None:
        return logits
    logits = logits.clone()
    for i in rows:
        ids = torch.tensor([t for t, _ in biases[i]], device=logits.device)
        logits[i].index_add_(0, ids, torch.tensor([b for _, b in biases[i]], device=logits.device))
    return logits


def _apply_openai_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    pres, freq, outs = batch.presence_penalties, batch.frequency_penalties, batch.output_token_ids
    if pres is None or freq is None or outs is None:
        return logits
    if pres.count(0.0) == len(pres) and freq.count(0.0) == len(freq):
        return logits
    rows = [i for i in range(len(pres)) if (pres[i] != 0.0 or freq[i] != 0.0) and outs[i]]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in rows:
        counts = torch.bincount(torch.tensor(outs[i], device=logits.device), minlength=vocab)[:vocab]
        logits[i] -= freq[i] * counts.to(logits.dtype) + pres[i] * (counts > 0).to(logits.dtype)
    return logits
