"""Automatic prefix caching in the engine: outputs identical to the cache off, hits counted, evictions safe."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.engine.test_engine import run_checked
from tests.tiny_models import build_tiny_checkpoint
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest
from worker.engine_config import EngineConfig
from worker.kernels import native_attention
from worker.kernels.cascade import MIN_SHARED_TOKENS

BLOCK = 4
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * BLOCK  # 2 x layers x kv_heads x head_dim x float32 bytes x tokens


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


def engine_with(ckpt: Path, blocks: int, prefix_cache: bool, **kw: object) -> Engine:
    cfg = EngineConfig(
        dtype="float32", model=str(ckpt), block_size=BLOCK, kv_cache_gb=blocks * BLOCK_BYTES / 1024**3,
        prefix_cache=prefix_cache, repetition_window=0, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    return Engine.load(cfg)


def shared_prefix_workload(seed: int, n: int) -> list[EngineRequest]:
    """Requests over a few shared prefixes of random lengths (block-aligned or not), some greedy, some
    sampled with a seed; a few identical prompts."""
    rng = random.Random(seed)
    prefixes = [[rng.randint(3, 250) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    prefixes.append([rng.randint(3, 250) for _ in range(4 * BLOCK)])  # exactly block-aligned
    reqs = []
    for i in range(n):
        prompt = rng.choice(prefixes) + [rng.randint(3, 250) for _ in range(rng.randint(0, 9))]
        if not prompt:
            prompt = [5]
        sampled = rng.random() < 0.4
        params = GenerationParams(
            max_new_tokens=rng.randint(1, 14), temperature=0.8 if sampled else 0.0, top_p=0.9,
            seed=rng.randint(0, 2**32), ignore_eos=rng.random() < 0.5,
        )  # fmt: skip
        reqs.append(EngineRequest(f"r{i}", params, prompt_token_ids=prompt))
    return reqs


def test_a_long_shared_prefix_decodes_the_same_through_cascade_attention(ckpt: Path) -> None:
    """Sequences sharing over MIN_SHARED_TOKENS of cached prefix decode through the cascade path (with
    batch_invariant off: cascade's sums follow the sequences that share the prefix); their tokens equal
    the cache-off run's, where every sequence attends over its own blocks."""
    rng = random.Random(5)
    prefix = [rng.randint(3, 250) for _ in range(MIN_SHARED_TOKENS + 3 * BLOCK + 2)]
    reqs = [
        EngineRequest(
            f"r{i}", GenerationParams(max_new_tokens=12, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True),
            prompt_token_ids=prefix + [rng.randint(3, 250) for _ in range(rng.randint(1, 9))],
        )
        for i in range(10)
    ]  # fmt: skip
    off = run_checked(engine_with(ckpt, 400, prefix_cache=False, batch_invariant=False), reqs)
    cached = engine_with(ckpt, 400, prefix_cache=True, batch_invariant=False)
    on = run_checked(cached, reqs)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert all(r.cached_tokens >= MIN_SHARED_TOKENS for r in on[1:])
    attn = cached.model_runner.backend.attention.paged_decode_attention.__self__  # type: ignore[attr-defined]
    if native_attention.library() is not None:  # cascade decode rides on the C kernel
        assert attn._cascade.shared_steps >= 5, "the shared prefix never went through cascade attention"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_outputs_with_the_cache_equal_outputs_without_it_even_under_eviction(ckpt: Path, seed: int) -> None:
    reqs = shared_prefix_workload(seed, 40)
    off = run_checked(engine_with(ckpt, 400, prefix_cache=False), reqs)
    small = engine_with(ckpt, 40, prefix_cache=True, max_num_seqs=6)  # a pool small enough to evict
    on = run_checked(small, reqs)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert [r.text for r in on] == [r.text for r in off]
    assert [r.prompt_tokens for r in on] == [r.prompt_tokens for r in off]
    assert all(r.cached_tokens == 0 for r in off)
    assert sum(r.cached_tokens for r in on) > 0
    assert small.block_manager.evicted_blocks > 0, "the pool never had to evict: make it smaller"
    stats = small.stats()
    assert stats.cached_prompt_tokens == sum(r.cached_tokens for r in on)
    assert small.block_manager.num_free == small.block_manager.num_blocks  # every block came back


def test_a_repeated_prompt_reuses_every_block_but_the_last(ckpt: Path) -> None:
    engine = engine_with(ckpt, 400, prefix_cache=True)
    prompt = list(range(10, 10 + 10 * BLOCK + 3))  # 43 tokens: 10 full blocks + 3
    p = GenerationParams(max_new_tokens=3, temperature=0.0)
    first = engine.generate([EngineRequest("a", p, prompt_token_ids=prompt)])[0]
    again = engine.generate([EngineRequest("b", p, prompt_token_ids=prompt)])[0]
    assert first.cached_tokens == 0 and again.cached_tokens == 10 * BLOCK
    assert again.token_ids == first.token_ids and again.prompt_tokens == first.prompt_tokens == 43
