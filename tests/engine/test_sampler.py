"""The sampler over a batch whose rows each ask for something else (greedy, temperature alone, min-p, top-k,
top-p, penalties, biases) picks, row by row, what the documented rule picks for that row alone: the
inverse CDF at the row's own uniform splitmix64(seed, step), over the sorted distribution where top-k or
top-p filters it and over the vocabulary's order otherwise."""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from worker.engine.sampler import Sampler, SamplingBatch, splitmix64_uniform

VOCAB = 3000


def reference(row: Tensor, temp: float, top_k: int, top_p: float, min_p: float, u: float) -> int:
    """One row by the rule, step by step."""
    if temp == 0.0:
        return int(row.argmax())
    x = row / temp
    order = None
    sort = top_k > 0 or top_p < 1.0
    if sort:
        x, order = x.sort(descending=True)
    if top_k > 0:
        x = x.masked_fill(torch.arange(x.shape[0]) >= top_k, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    drop = torch.zeros_like(probs, dtype=torch.bool)
    if sort:
        drop |= (probs.cumsum(-1) - probs) >= top_p
    drop |= probs < min_p * probs.max()
    drop[probs.argmax()] = False
    cdf = probs.masked_fill(drop, 0.0).cumsum(-1)
    pick = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])]), right=True).clamp(max=VOCAB - 1))
    return pick if order is None else int(order[pick])


def batch_of(
    settings: list[tuple[float, int, float, float]], seeds: list[int], steps: list[int]
) -> SamplingBatch:
    n = len(settings)
    temps, top_ks, top_ps, min_ps = (list(col) for col in zip(*settings, strict=True))
    return SamplingBatch(
        temperatures=temps, top_ks=top_ks, top_ps=top_ps, min_ps=min_ps, repetition_penalties=[1.0] * n,
        seen_token_ids=[[]] * n, seeds=seeds, steps=steps,
    )  # fmt: skip


def test_each_row_of_a_mixed_batch_samples_what_the_rule_gives_it_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    # every combination of temperature (0: greedy), top-k, top-p and min-p, twice
    kinds = list(itertools.product((0.0, 0.3, 1.0, 1.7), (0, 5, 200), (1.0, 0.9, 0.5), (0.0, 0.05)))
    settings = kinds + kinds
    n = len(settings)
    logits = torch.randn(n, VOCAB, generator=gen) * 3
    seeds, steps = list(range(100, 100 + n)), [(7 * i) % 13 for i in range(n)]
    got = Sampler()(logits.clone(), batch_of(settings, seeds, steps)).tolist()
    want = [
        reference(logits[i], *settings[i], splitmix64_uniform(seeds[i], steps[i]))  # type: ignore[misc]
        for i in range(n)
    ]
    assert got == want
    assert len({t for t, s in zip(got, settings, strict=True) if s[0] > 0}) > n // 3  # it does sample


def test_a_batch_of_one_kind_samples_as_the_rule_does() -> None:
    """Whole batches of temperature alone, of greedy, of min-p alone: the paths a uniform batch takes."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, VOCAB, generator=gen) * 2
    seeds, steps = list(range(64)), [3] * 64
    for kind in ((0.8, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.1), (0.7, 40, 0.95, 0.0)):
        got = Sampler()(logits.clone(), batch_of([kind] * 64, seeds, steps)).tolist()
        u = [splitmix64_uniform(s, t) for s, t in zip(seeds, steps, strict=True)]
        assert got == [reference(logits[i], *kind, u[i]) for i in range(64)], kind  # type: ignore[misc]
