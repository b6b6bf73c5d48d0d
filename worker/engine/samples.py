"""n > 1 and best_of: one request's samples, run as sequences that share its prompt. Pure Python.

A request that asks for several samples (GenerationParams.samples: best_of, else n) becomes a group: its
first sample, the leader, is admitted and prefilled like any sequence, under a reservation that covers
every sample (Scheduler.blocks_needed); the other samples wait, "pending", in the leader's `forks`. The
step that completes the leader's prompt also samples each fork's first token, from the leader's last
logits row with the fork's own seed; then each fork starts running with the leader's full prompt blocks
shared by reference count and its own copy of the partial last block (BlockManager.fork): its next token
is written there, so the copy is the copy-on-write, made at the moment a write is certain. The prompt is
computed once.

Sample i samples with seed `sample_seed(seed, i)`: sample 0 with the request's own seed (an n=1 request
with that seed is its sample 0), sample i > 0 with a splitmix64 mix of (seed, i). The sampler draws a
row's uniforms from (its seed, its step) alone, so each sample is the same alone or in a batch, and a
preempted sample resumes with the tokens it would have drawn.

A `choices` request forks nothing: its labels' scores are exact, so its samples are draws of a label from
them, one per sample seed (Engine._finish_choices). best_of > n: the n samples of highest cumulative
logprob (raw model log-probabilities of every generated token, a final EOS included; a label's score for
a `choices` request) are returned, best first; otherwise all of them in sample order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.request import EngineResult, RequestError
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence

_MASK64 = (1 << 64) - 1
SAMPLE_ID_SEP = "\x1f"  # sample i > 0 of request r runs as sequence f"{r}\x1f{i}" (no job id holds it)


def sample_seed(seed: int, index: int) -> int:
    """Sample `index`'s seed, in [0, 2**63): the request's own for sample 0."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def fork_samples(
    leader: Sequence, detokenizer: Callable[[], IncrementalDetokenizer], matcher: Callable[[], Any]
) -> list[Sequence]:
    """Make `leader` (a new, waiting sequence) sample 0 of its request and attach samples 1 to
    samples - 1 as its pending forks, each with its seed, detokenizer and grammar state. -> the forks."""
    p = leader.params
    leader.group, leader.ranked = leader.request_id, p.samples > p.n
    leader.forks = [
        dataclasses.replace(
            leader,
            request_id=f"{leader.request_id}{SAMPLE_ID_SEP}{i}",
            params=dataclasses.replace(p, seed=sample_seed(p.seed, i)),
            detokenizer=detokenizer(),
            matcher=matcher(),
            output_ids=[],
            token_logprobs=[],
            forks=[],
            status="pending",
            sample_index=i,
            # a reasoning model's sample thinks on its own (its place, its thinking's ids and text)
            reasoning=None if leader.reasoning is None else leader.reasoning.copy(),
            reasoning_ids=[],
            reasoning_detokenizer=None if leader.reasoning_detokenizer is None else detokenizer(),
        )
        for i in range(1, p.samples)
    ]
    return leader.forks


def plan_samples(
    seq: Sequence,
    scheduler: Scheduler,
    detokenizer: Callable[[], IncrementalDetokenizer],
    matcher: Callable[[], Any],
) -> list[Sequence]:
    """The samples to fork from a new sequence (fork_samples), none for one sample or a `choices` request;
    RequestError where the group could never run: more samples than max_num_seqs, or more blocks than the
    pool holds (its prompt shared, each sample's own part counted)."""
    p = seq.params
    if p.samples == 1 or seq.scores_labels:  # (a reasoning model's choices request: one thought, then labels)
        return []
    if p.samples > scheduler.max_num_seqs:
        raise RequestError(
            "invalid_request",
            f"request asks for {p.samples} samples (n / best_of), but the worker runs at most "
            f"{scheduler.max_num_seqs} sequences at once (max_num_seqs)",
        )
    forks = fork_samples(seq, detokenizer, matcher)
    if not scheduler.fits_pool_at_all(seq):
        bm = scheduler.block_manager
        raise RequestError(
            "kv_capacity",
            f"request needs {scheduler.blocks_needed(seq)} KV blocks for its {p.samples} samples ({seq.prompt_len} "
            f"prompt tokens shared + {seq.max_new_tokens} new tokens each, {bm.block_size} per block) but the "
            f"whole pool has {bm.num_blocks} blocks",
        )
    return forks


def best_samples(n: int, ranks: list[float] | None) -> list[int]:
    """Which samples a request returns, in order: the n of highest rank (the first on a tie), or with no
    ranks (best_of == n) every sample in sample order."""
    if ranks is None:
        return list(range(n))
    return sorted(range(len(ranks)), key=lambda i: (-ranks[i], i))[:n]


def combine(request_id: str, results: list[EngineResult], n: int, ranks: list[float] | None) -> EngineResult:
    """The request's result from every sample's (in sample order): the returned samples in `samples`, the
    first of them in the top-level fields; usage counts the prompt once and every generated token (best_of's
    discarded samples too: they were computed). Any sample's error fails the request."""
    error = next((r.error for r in results if r.error is not None), None)
    kept = [results[i] for i in best_samples(n, ranks)]
    first = results[0] if error is not None else kept[0]
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    return EngineResult(
        request_id=request_id,
        text="" if error is not None else first.text,
        token_ids=[] if error is not None else first.token_ids,
        finish_reason="error" if error is not None else first.finish_reason,
        prompt_tokens=results[0].prompt_tokens,
        completion_tokens=sum(r.completion_tokens for r in results),
        cached_tokens=results[0].cached_tokens,
        ttft_s=min(ttfts) if ttfts and error is None else None,
        total_s=max(r.total_s for r in results),
        error=error,
        label_scores=results[0].label_scores,
        logprobs=None if error is not None else first.logprobs,
        samples=None if error is not None else kept,
        # a reasoning model's: the first sample's thinking; its tokens counted as completion_tokens are
        reasoning_content=None if error is not None else first.reasoning_content,
        reasoning_tokens=sum(r.reasoning_tokens for r in results),
    )


class SampleGroup:
    """A request's samples while they run: each one's result as it ends, the request's once all have."""

    def __init__(self, leader: Sequence) -> None:
        self.request_id = leader.request_id
        self.members = [leader, *leader.forks]
        self.n = leader.params.n
        self._results: list[EngineResult | None] = [None] * len(self.members)

    def record(self, index: int, result: EngineResult) -> EngineResult | None:
        """Sample `index` ended with `result`. -> the request's result when it was the last to end."""
        assert self._results[index] is None, f"sample {index} of {self.request_id} ended twice"
        self._results[index] = result
        done = [r for r in self._results if r is not None]
        if len(done) < len(self._results):
            return None
        ranked = self.members[0].ranked
        ranks = [m.cumulative_logprob for m in self.members] if ranked else None
        return combine(self.request_id, done, self.n, ranks)
