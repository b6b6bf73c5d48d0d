"""A row's numbers never depend on its neighbours: on the real model, under the engine's default dtype and
under the other one (float32 where the default is bfloat16, and the reverse), the same `choices`, greedy and embedding lines give the same bits alone, beside
lines of every other kind, with their prompt cut into other chunks, and after a prefix-cache hit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.tiny_models import build_tiny_checkpoint
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EmbeddingInputs, EngineRequest, EngineResult
from worker.engine_config import EngineConfig

pytestmark = pytest.mark.slow

# Longer than cascade attention's MIN_SHARED_TOKENS, so neighbours that share it would (without batch
# invariance) decode over a shared prefix together.
INSTRUCTION = (
    "You label customer reviews for an online shop. Read the review, think about the customer's overall "
    "feeling toward the product and the service, and answer with one word. Reviews can be short or long, "
    "polite or rude, and may mention delivery, price, quality, support, or packaging. Ignore spelling "
    "mistakes and focus on what the customer would tell a friend about the purchase."
)
REVIEWS = [
    "The zipper broke on day one.",
    "Arrived early, fits perfectly, and the colour is exactly as shown.",
    "It's fine. Does what it says, nothing more.",
    "Support never answered my three emails, but the blender itself is great.",
    "Worst purchase this year: the seams split after a single wash and the refund took a month.",
]
LABELS = ("positive", "negative", "neutral", "mixed")
STORY = (
    "The lighthouse keeper wrote in his log every evening: the weather, the ships that passed, the birds "
    "that rested on the rail. "
)


def chat(review: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": review}]


def label(i: int, review: str = REVIEWS[0]) -> EngineRequest:
    params = GenerationParams(max_new_tokens=1, temperature=0.0, choices=LABELS, logprobs=True)
    return EngineRequest(f"label{i}", params, messages=chat(review))


def greedy(i: int, review: str = REVIEWS[1]) -> EngineRequest:
    params = GenerationParams(max_new_tokens=12, temperature=0.0, logprobs=True, top_logprobs=2)
    return EngineRequest(f"greedy{i}", params, messages=chat(review))


def embed(i: int) -> EngineRequest:
    inputs = EmbeddingInputs([INSTRUCTION + " " + REVIEWS[2], "a short text"])
    return EngineRequest(f"embed{i}", GenerationParams(max_new_tokens=1), embedding=inputs)


def long_prompt(i: int) -> EngineRequest:
    # several steps' worth of tokens under the test engine's budget: the subjects' prompts are chunked
    # differently beside it than alone
    params = GenerationParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    return EngineRequest(f"long{i}", params, prompt=STORY * 12)


def sampled(i: int) -> EngineRequest:
    params = GenerationParams(max_new_tokens=6, temperature=0.8, seed=7, n=3)
    return EngineRequest(f"n{i}", params, messages=chat(REVIEWS[3]))


def neighbours(i: int) -> list[EngineRequest]:
    """Lines of every other kind: batch-wide labels on other reviews (sharing the instruction), n > 1,
    embeddings, a long prompt and a short one."""
    others = [label(100 + i * 10 + j, r) for j, r in enumerate(REVIEWS[1:])]
    short = EngineRequest(f"short{i}", GenerationParams(max_new_tokens=3, temperature=0.0), prompt="Hi")
    return [*others, sampled(i), embed(200 + i), long_prompt(i), short, greedy(300 + i, REVIEWS[4])]


Bits = tuple[object, ...]


def bits(r: EngineResult) -> Bits:
    """Everything a row's numbers decide, as exact values."""
    scores = [(s.label, s.logprob) for s in r.label_scores or []]
    lps = [(lp.token, lp.logprob, [(c.token, c.logprob) for c in lp.top]) for lp in r.logprobs or []]
    return (r.text, tuple(r.token_ids), tuple(scores), tuple(map(repr, lps)), repr(r.embeddings))


SUBJECTS: list[Callable[[int], EngineRequest]] = [label, greedy, embed]


def compositions(engine: Engine) -> dict[str, list[Bits]]:
    """The subjects' bits in each composition, fresh pools first (no prefix cached), then cached."""
    got: dict[str, list[Bits]] = {}
    engine.block_manager.reset_prefix_cache()
    got["alone"] = [bits(engine.generate([s(0)])[0]) for s in SUBJECTS]
    engine.block_manager.reset_prefix_cache()
    mixed = engine.generate([*neighbours(1)[:4], *[s(1) for s in SUBJECTS], *neighbours(1)[4:]])
    got["beside every kind of line"] = [bits(r) for r in mixed[4 : 4 + len(SUBJECTS)]]
    engine.block_manager.reset_prefix_cache()
    first = engine.generate([long_prompt(2), *[s(2) for s in SUBJECTS]])
    got["behind a long prompt (other chunks)"] = [bits(r) for r in first[1:]]
    got["after a prefix-cache hit"] = [bits(engine.generate([s(3)])[0]) for s in SUBJECTS]
    many = engine.generate(
        [*(label(400 + j, r) for j, r in enumerate(REVIEWS * 3)), *[s(4) for s in SUBJECTS]]
    )
    got["beside 15 labels, cached"] = [bits(r) for r in many[len(REVIEWS) * 3 :]]
    return got


def check_invariant(engine: Engine) -> None:
    got = compositions(engine)
    want = got["alone"]
    assert want[0][2] and want[1][3] and want[2][4] != "None", "the subjects scored, logged and embedded"
    for name, value in got.items():
        for subject, a, b in zip(SUBJECTS, want, value, strict=True):
            assert a == b, f"{subject.__name__} {name}: not the bits it has alone"


@pytest.fixture(scope="module")
def default_engine() -> Engine:
    # max_num_batched_tokens 256: a prompt of a few hundred tokens takes several steps, cut where the
    # other lines of its step leave room
    return Engine.load(EngineConfig(model="smollm2-135m", kv_cache_gb=0.3, max_num_batched_tokens=256))


def test_the_default_dtype_gives_a_row_the_same_bits_in_every_batch(default_engine: Engine) -> None:
    assert default_engine.batch_invariant
    check_invariant(default_engine)


def test_the_other_dtype_gives_a_row_the_same_bits_in_every_batch(default_engine: Engine) -> None:
    # The default is bfloat16 where linear.c multiplies in bfloat16 (AVX-512 BF16), float32 elsewhere: the
    # other one is forced here, so both dtypes are checked on every machine.
    default_bf16 = default_engine.model_runner.kv_caches[0][0].dtype.itemsize == 2
    other = "float32" if default_bf16 else "bfloat16"
    engine = Engine.load(
        EngineConfig(model="smollm2-135m", dtype=other, kv_cache_gb=0.3, max_num_batched_tokens=256)
    )
    assert engine.batch_invariant
    assert engine.fingerprint != default_engine.fingerprint, "the result cache never mixes dtypes"
    want = 4 if other == "float32" else 2  # bfloat16 keeps its KV cache narrow
    assert engine.model_runner.kv_caches[0][0].dtype.itemsize == want
    check_invariant(engine)


def test_the_fingerprint_follows_the_dtype_and_batch_invariance(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "m", "llama")
    base = EngineConfig(model=str(path), kv_cache_gb=0.01)
    prints = {
        (dtype, invariant): Engine.load(
            base.model_copy(update={"dtype": dtype, "batch_invariant": invariant})
        )
        for dtype, invariant in (("float32", True), ("float32", False), ("bfloat16", True))
    }
    assert prints[("float32", True)].batch_invariant and not prints[("float32", False)].batch_invariant
    assert len({e.fingerprint for e in prints.values()}) == 3


def family_cases() -> list[tuple[str, str, dict[str, object]]]:
    from tests.engine.test_moe_models import ARCHS as MOE
    from tests.engine.test_tiny_models import ARCHS as DENSE

    return [(name, arch, over) for name, (arch, over) in sorted({**DENSE, **MOE}.items())]


@pytest.mark.parametrize(("name", "arch", "overrides"), family_cases(), ids=[c[0] for c in family_cases()])
def test_every_family_gives_a_row_the_same_bits_in_every_batch(
    tmp_path: Path, name: str, arch: str, overrides: dict[str, object]
) -> None:
    # Every native family on the kernels the engine picks for it (windows, softcaps, partial rotary, experts
    # routed by what else is in the step): a greedy line with logprobs and a choices line, alone and beside
    # others that share their prefix, with their prompts cut into other chunks, after a prefix-cache hit.
    path = build_tiny_checkpoint(tmp_path / name, arch, seed=5, **overrides)
    engine = Engine.load(
        EngineConfig(
            model=str(path), kv_cache_gb=0.02, block_size=8, max_num_batched_tokens=48, max_num_seqs=16
        )
    )
    assert engine.batch_invariant
    shared = list(range(3, 90))  # longer than cascade's MIN_SHARED_TOKENS
    lp = GenerationParams(max_new_tokens=10, temperature=0.0, logprobs=True, top_logprobs=2, ignore_eos=True)
    ch = GenerationParams(max_new_tokens=1, temperature=0.0, choices=("ab", "b", "cde"))

    def subjects(tag: str) -> list[EngineRequest]:
        return [
            EngineRequest(f"g{tag}", lp, prompt_token_ids=[*shared, 7, 8]),
            EngineRequest(f"c{tag}", ch, prompt_token_ids=[*shared, 9]),
        ]

    others = [
        EngineRequest(f"o{i}", lp, prompt_token_ids=[*shared, 100 + i, 50, 60 + i]) for i in range(5)
    ] + [EngineRequest("long", lp, prompt_token_ids=list(range(120, 250)))]
    engine.block_manager.reset_prefix_cache()
    alone = [bits(engine.generate([r])[0]) for r in subjects("a")]
    engine.block_manager.reset_prefix_cache()
    mixed = engine.generate([others[-1], *subjects("m"), *others[:-1]])
    assert [bits(r) for r in mixed[1:3]] == alone, f"{name}: beside others"
    cached = engine.generate([*others[:3], *subjects("c")])
    assert [bits(r) for r in cached[3:]] == alone, f"{name}: after a prefix-cache hit"
