"""Sliding-window models against Hugging Face float32, through the production loader: tiny Mistral (every
layer windowed: the window releases blocks as sequences advance), tiny Qwen2 with max_window_layers
leaving its first layer full (one table for every layer: nothing released, the idle blocks counted), and
Gemma 2 / Gemma 3 on the native decoder, their local and global layers interleaved by layer_types (Gemma 2
soft-capped, Gemma 3 with its own rotary base for the local layers). Greedy
tokens over prompts longer than the window in mixed batches, label scores and logprobs, the prefix cache
over a shared prefix longer than the window, and a sequence far longer than the pool could hold without the
window. The layers' windows are read from each config as transformers builds its modules.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from greedy_parity import check_greedy, hf_greedy
from transformers import AutoModelForCausalLM

from tests.tiny_models import build_tiny_checkpoint, hf_reference, tiny_config
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest, EngineResult
from worker.engine_config import EngineConfig
from worker.models.spec import UnsupportedLayers, sliding_windows

WINDOW = 16
MODELS = {
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "qwen2-mixed": (
        "qwen2",
        {
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 1,
            "num_hidden_layers": 3,
        },
    ),
    # local, global, local (Gemma 2 alternates from a sliding first layer)
    "gemma2": (
        "gemma2",
        {"head_dim": 16, "query_pre_attn_scalar": 64, "attn_logit_softcapping": 4.0, "sliding_window": WINDOW}
        | {"num_hidden_layers": 3},
    ),
    # local, local, global
    "gemma3": (
        "gemma3",
        {"head_dim": 16, "sliding_window": WINDOW, "num_hidden_layers": 3, "sliding_window_pattern": 3}
        | {"rope_local_base_freq": 100.0},
    ),
}
LAYER_WINDOWS = {
    "mistral": (WINDOW, WINDOW),
    "qwen2-mixed": (None, WINDOW, WINDOW),
    "gemma2": (WINDOW, None, WINDOW),
    "gemma3": (WINDOW, WINDOW, None),
}
# Five prompts, three well longer than the window (up to 5x), one shorter, one a single token
PROMPTS = [[5, 6, 7], list(range(10, 60)), [200, 100] * 40, [42], list(range(3, 120, 2))]
NEW = 16


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    arch, overrides = MODELS[request.param]
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp(request.param), arch, seed=5, **overrides
    ), request.param


def load(path: Path, **settings: object) -> Engine:
    settings.setdefault("kv_cache_gb", 0.01)
    return Engine.load(EngineConfig(dtype="float32", model=str(path), block_size=8, **settings))  # type: ignore[arg-type]


def greedy(max_new: int = NEW) -> GenerationParams:
    return GenerationParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)


def run_checked(engine: Engine, reqs: list[EngineRequest]) -> list[EngineResult]:
    """generate(), checking the scheduler's invariants (the window's included) after every step."""
    for r in reqs:
        engine.add_request(r)
    done: dict[str, EngineResult] = {}
    while engine.has_work():
        for res in engine.step():
            done[res.request_id] = res
        engine.scheduler.check_invariants()
    return [done[r.request_id] for r in reqs]


def hf_model(path: Path) -> torch.nn.Module:
    return hf_reference(path)


def test_layer_windows_are_the_ones_transformers_builds() -> None:
    """Each family's rule (loader.SUPPORTED) gives the windows Hugging Face's modules attend with: Qwen2 and
    Qwen3 per layer from max_window_layers, Mistral and Phi-3 every layer by sliding_window, Gemma 2 and 3
    per layer_types; nothing where the config says nothing slides."""
    cases = [
        ("qwen2", "layer_types", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 2,
                                  "num_hidden_layers": 4}),
        ("qwen2", "layer_types", {"use_sliding_window": False, "sliding_window": 12}),
        ("qwen3", "layer_types", {"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 0}),
        ("gemma2", "layer_types", {"head_dim": 16, "sliding_window": 9, "num_hidden_layers": 4}),
        ("gemma3", "layer_types", {"head_dim": 16, "sliding_window": 9, "num_hidden_layers": 4,
                                   "sliding_window_pattern": 2}),
    ]  # fmt: skip
    for arch, rule, overrides in cases:
        cfg = tiny_config(arch, **overrides)
        hf = AutoModelForCausalLM.from_config(cfg)
        built = tuple(layer.self_attn.sliding_window for layer in hf.model.layers)
        assert sliding_windows(cfg, rule) == built, (arch, overrides)
    # Mistral's and Phi-3's modules pass config.sliding_window to every layer's attention; Llama has none
    assert sliding_windows(tiny_config("mistral", sliding_window=5), "every_layer") == (5, 5)
    assert sliding_windows(tiny_config("mistral", sliding_window=None), "every_layer") == (None, None)
    assert sliding_windows(tiny_config("phi3", sliding_window=30), "every_layer") == (30, 30)
    assert sliding_windows(tiny_config("llama"), "none") == (None, None)
    with pytest.raises(UnsupportedLayers, match=r"layer types \['chunked_attention'\]"):
        sliding_windows(
            tiny_config("qwen2", layer_types=["full_attention", "chunked_attention"]), "layer_types"
        )


@pytest.mark.parametrize("cpu_kernels", ["auto", "torch"])
def test_greedy_matches_hf_generate_in_mixed_batches(model: tuple[Path, str], cpu_kernels: str) -> None:
    path, name = model
    hf = hf_model(path)
    engine = load(
        path, cpu_kernels=cpu_kernels, max_num_batched_tokens=40, max_num_seqs=8
    )  # chunks beside decodes
    assert engine.model_runner.model.layer_windows == LAYER_WINDOWS[name]
    results = run_checked(
        engine, [EngineRequest(f"r{i}", greedy(), prompt_token_ids=p) for i, p in enumerate(PROMPTS)]
    )
    for i, (prompt, res) in enumerate(zip(PROMPTS, results, strict=True)):
        theirs, logits = hf_greedy(hf, prompt, NEW, ignore_eos=True)
        assert check_greedy(i, res.token_ids, theirs, logits) is None, (name, i)
    stats = engine.stats()
    if name == "mistral":  # every layer windowed: the long sequences gave blocks back as they advanced
        assert stats.window_released_blocks > 0 and engine.block_manager.window is not None
    else:  # a full layer shares the table: nothing released
        assert stats.window_released_blocks == 0 and engine.block_manager.window is None


def test_the_window_changes_what_hf_generates_here(model: tuple[Path, str]) -> None:
    """The comparisons above can fail: without its window the same model generates other tokens for the
    prompts longer than the window."""
    path, _ = model
    hf = hf_model(path)
    windowed = [hf_greedy(hf, p, NEW, ignore_eos=True)[0] for p in PROMPTS[1:3]]
    hf.config.sliding_window = 10_000
    for layer in hf.model.layers:
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            layer.self_attn.sliding_window = 10_000
    assert [hf_greedy(hf, p, NEW, ignore_eos=True)[0] for p in PROMPTS[1:3]] != windowed


def test_label_scores_and_token_logprobs_match_hf(model: tuple[Path, str]) -> None:
    from tests.engine.test_labeling import check_labels_and_logprobs_match_hf

    path, _ = model
    check_labels_and_logprobs_match_hf(load(path), hf_model(path))  # prompts of 5, 25 and 33 tokens


def test_a_cached_prefix_longer_than_the_window_is_reused_and_exact(model: tuple[Path, str]) -> None:
    path, name = model
    hf = hf_model(path)
    engine = load(path)
    shared = list(range(20, 84))  # 64 tokens: four windows, eight blocks
    first = run_checked(engine, [EngineRequest("warm", greedy(4), prompt_token_ids=[*shared, 7])])[0]
    assert first.cached_tokens == 0
    prompts = [[*shared, 9, 10], [*shared, 11], [*shared, 3, 4, 5, 6, 7, 8, 9]]
    results = run_checked(
        engine, [EngineRequest(f"p{i}", greedy(), prompt_token_ids=p) for i, p in enumerate(prompts)]
    )
    for i, (prompt, res) in enumerate(zip(prompts, results, strict=True)):
        assert res.cached_tokens >= len(shared) - 8, (name, i, res.cached_tokens)
        theirs, logits = hf_greedy(hf, prompt, NEW, ignore_eos=True)
        assert check_greedy(i, res.token_ids, theirs, logits) is None, (name, i)


def test_labels_scored_over_a_cached_prefix_longer_than_the_window_equal_hf(model: tuple[Path, str]) -> None:
    """A choices request whose prompt extends a cached prefix four windows long: its hit leaves out the
    blocks no window reaches (every layer windowed) or takes them all, and its label scores are HF's."""
    from tests.engine.test_labeling import LABELS, hf_label_logprob

    path, name = model
    hf = hf_model(path)
    engine = load(path)
    shared = list(range(20, 84))
    run_checked(engine, [EngineRequest("warm", greedy(2), prompt_token_ids=[*shared, 7])])
    prompt = [*shared, 9, 10, 11]
    params = GenerationParams(max_new_tokens=1, temperature=0.0, choices=LABELS)
    res = run_checked(engine, [EngineRequest("c", params, prompt_token_ids=prompt)])[0]
    assert res.cached_tokens == len(shared) and res.label_scores is not None
    eos = engine.eos_token_ids[0]
    for score, label in zip(res.label_scores, engine.prompts.label_ids(LABELS), strict=True):
        assert abs(score.logprob - hf_label_logprob(hf, prompt, label, eos)) < 1e-4, (name, score)


def test_a_windowed_model_serves_a_sequence_far_longer_than_the_pool(tmp_path: Path) -> None:
    """A pool of 6 blocks of 8 tokens (48 tokens): with every layer windowed at 16 and chunks of 8, one
    sequence holds at most 4 blocks at once, so a 40-token prompt with 100 new tokens (140 tokens, 18 blocks)
    runs, equal to Hugging Face; the same request to a model without a window is refused at once."""
    arch, overrides = MODELS["mistral"]
    path = build_tiny_checkpoint(tmp_path / "mistral", arch, seed=5, **overrides)
    block_bytes = 2 * 2 * 2 * 16 * 4 * 8  # K and V x layers x kv heads x head dim x float32 x tokens
    pool = {"kv_cache_gb": 6 * block_bytes / 1024**3, "max_num_batched_tokens": 8, "max_num_seqs": 1}
    engine = load(path, **pool)
    assert engine.block_manager.num_blocks == 6
    prompt = list(range(30, 70))
    res = run_checked(engine, [EngineRequest("long", greedy(100), prompt_token_ids=prompt)])[0]
    assert res.error is None and len(res.token_ids) == 100
    theirs, logits = hf_greedy(hf_model(path), prompt, 100, ignore_eos=True)
    assert check_greedy(0, res.token_ids, theirs, logits) is None
    assert engine.stats().window_released_blocks >= 18 - 4
    assert engine.block_manager.num_free == 6
    full = build_tiny_checkpoint(tmp_path / "mistral-full", arch, seed=5, sliding_window=None)
    refused = load(full, **pool).generate([EngineRequest("long", greedy(100), prompt_token_ids=prompt)])[0]
    assert refused.error is not None and refused.error.type == "kv_capacity"


def test_layers_beside_full_ones_count_the_blocks_they_no_longer_read(tmp_path: Path) -> None:
    """Qwen2 with a full first layer: nothing is released, and the stats count the held blocks its windowed
    layers no longer read."""
    arch, overrides = MODELS["qwen2-mixed"]
    engine = load(build_tiny_checkpoint(tmp_path / "qwen2", arch, seed=5, **overrides))
    engine.add_request(EngineRequest("long", greedy(40), prompt_token_ids=list(range(10, 60))))
    idle = []
    while engine.has_work():
        engine.step()
        idle.append(engine.stats().window_idle_blocks)
        engine.scheduler.check_invariants()
    # 50 tokens, then 40 more: at most, the blocks before the window of the token at 88 (the 39th new one)
    assert max(idle) == (88 - WINDOW + 1) // 8 and idle[-1] == 0
    assert engine.stats().window_released_blocks == 0
