"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss) on the native decoder: greedy tokens
equal to Hugging Face's float32 generate on tiny random checkpoints (random routers and experts, perturbed
norms, biases and sinks), through the production loader, with the C kernels (moe.c, linear.c) and on the torch
path; prompts longer than every sliding window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from greedy_parity import check_greedy, hf_greedy
from transformers import AutoModelForCausalLM

from tests.tiny_models import build_tiny_checkpoint
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest
from worker.engine_config import EngineConfig
from worker.models.moe import MoE

ARCHS = {
    # softmax over 4 experts, top 2 renormalised; every layer slides over 16 keys
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16}),
    # 8 experts top 2 unnormalised, a shared expert behind its sigmoid gate; layer 1 dense (mlp_only_layers)
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "num_hidden_layers": 3,
            "mlp_only_layers": [1],
        },
    ),
    # 8 experts top 4 renormalised, per-head qk norms; decoder_sparse_step 2: experts in layers 1 and 3 only
    "qwen3_moe": (
        "qwen3_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "head_dim": 32,
            "num_hidden_layers": 4,
            "decoder_sparse_step": 2,
        },
    ),
    # router bias, softmax over the top-2 logits, clamped SwiGLU with expert biases, sinks, sliding layers of 8
    # keys between full ones, yarn rope
    "gpt_oss": (
        "gpt_oss",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 16,
            "sliding_window": 8,
            "num_hidden_layers": 3,
            "swiglu_limit": 1.0,
        },
    ),
}
PROMPTS = [[5, 6, 7], list(range(10, 60)), [200, 100] * 20, [42], list(range(3, 90, 2)), [9] * 21]
NEW = 16


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    arch, overrides = ARCHS[request.param]
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp(request.param), arch, seed=1, **overrides
    ), request.param


@pytest.mark.parametrize("cpu_kernels", ["auto", "torch"])
def test_greedy_matches_hf_generate(tiny: tuple[Path, str], cpu_kernels: str) -> None:
    path, name = tiny
    cfg = EngineConfig(
        dtype="float32", model=str(path), kv_cache_gb=0.01, block_size=8, cpu_kernels=cpu_kernels
    )
    engine = Engine.load(cfg)
    model = engine.model_runner.model
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes, "the family loads as a mixture of experts"
    backend = engine.model_runner.backend
    if cpu_kernels == "auto" and backend.linear.name == "c":
        assert all(m.method.name == "c" for m in moes)  # moe.c runs the experts
    else:
        assert all(m.method.name == "torch" for m in moes)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = GenerationParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)
    reqs = [EngineRequest(f"r{i}", params, prompt_token_ids=p) for i, p in enumerate(PROMPTS)]
    ties = []
    for i, (prompt, res) in enumerate(zip(PROMPTS, engine.generate(reqs), strict=True)):
        theirs, logits = hf_greedy(hf, prompt, NEW, ignore_eos=True)
        assert len(res.token_ids) == NEW
        tie = check_greedy(i, res.token_ids, theirs, logits)
        if tie is not None:
            ties.append(tie)
    assert len(ties) <= 1, f"{name}: too many near-ties {ties}"


def test_stats_and_metrics_count_tokens_per_expert_per_layer(tmp_path: Path) -> None:
    """Every token each MoE layer computes is routed to top_k experts: the engine's stats count them per
    expert and layer (dense layers absent), and the worker's metrics expose the same counts."""
    from prometheus_client.core import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from worker.engine.async_engine import AsyncEngine
    from worker.queue.health import EngineFacts
    from worker.queue.metrics import WorkerCollector

    arch, overrides = ARCHS["qwen3_moe"]  # experts in layers 1 and 3, 8 experts top 4
    path = build_tiny_checkpoint(tmp_path, arch, seed=2, **overrides)
    engine = Engine.load(EngineConfig(dtype="float32", model=str(path), kv_cache_gb=0.01, block_size=8))
    assert engine.stats().expert_tokens == {1: [0] * 8, 3: [0] * 8}  # the load's scratch passes not counted
    prompts = [list(range(10, 40)), [7, 8, 9], [200] * 11]
    params = GenerationParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    engine.generate([EngineRequest(f"r{i}", params, prompt_token_ids=p) for i, p in enumerate(prompts)])
    stats = engine.stats()
    # each prompt token computed once (no shared prefix to cache), each generated token but the last fed back
    computed = stats.prompt_tokens - stats.cached_prompt_tokens + len(prompts) * (6 - 1)
    assert sorted(stats.expert_tokens) == [1, 3]
    for counts in stats.expert_tokens.values():
        assert sum(counts) == 4 * computed and len(counts) == 8
    assert stats.expert_tokens[1] != stats.expert_tokens[3]  # two routers, two distributions

    labels = {"model": "tiny", "queue": "q", "worker": "w"}
    aengine = AsyncEngine(engine)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(labels, aengine, EngineFacts.of(aengine), lambda: None))
    text = generate_latest(registry).decode()
    for layer, counts in stats.expert_tokens.items():
        for e, n in enumerate(counts):
            line = f'batchq_moe_expert_tokens_total{{expert="{e}",layer="{layer}",model="tiny",queue="q",worker="w"}}'
            assert f"{line} {float(n)}" in text, line


def test_bfloat16_weights_keep_the_experts_bfloat16(tmp_path: Path) -> None:
    """weight_dtype bfloat16 stores the experts (and every linear) as bfloat16, which moe.c widens as it
    reads: greedy equal to HF float32 on the same weights rounded to bfloat16."""
    arch, overrides = ARCHS["mixtral"]
    path = build_tiny_checkpoint(tmp_path, arch, seed=4, **overrides)
    cfg = EngineConfig(
        dtype="float32", weight_dtype="bfloat16", model=str(path), kv_cache_gb=0.01, block_size=8
    )
    try:
        engine = Engine.load(cfg)
    except ValueError as e:  # no C linear kernel here
        pytest.skip(str(e))
    moes = [m for m in engine.model_runner.model.modules() if isinstance(m, MoE)]
    assert moes and all(m.gate_up.dtype == m.down.dtype == torch.bfloat16 for m in moes)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2 and "embed_tokens" not in name:  # the linears', the router's and the experts'
                p.copy_(p.bfloat16().float())
    params = GenerationParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)
    results = engine.generate(
        [EngineRequest(f"r{i}", params, prompt_token_ids=p) for i, p in enumerate(PROMPTS)]
    )
    ties = [t for i, (p, r) in enumerate(zip(PROMPTS, results, strict=True))
            if (t := check_greedy(i, r.token_ids, *hf_greedy(hf, p, NEW, ignore_eos=True))) is not None]  # fmt: skip
    assert len(ties) <= 1, ties


def test_a_missing_expert_or_an_impossible_top_k_is_a_clear_load_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from worker.models.errors import ModelLoadError

    arch, overrides = ARCHS["mixtral"]
    path = build_tiny_checkpoint(tmp_path / "m", arch, **overrides)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError, match=r"'model.layers.1.block_sparse_moe.experts.3.w3.weight' is not in"
    ):
        Engine.load(EngineConfig(dtype="float32", model=str(path), kv_cache_gb=0.01))

    bad = build_tiny_checkpoint(tmp_path / "k", arch, **{**overrides, "num_experts_per_tok": 5})
    with pytest.raises(ModelLoadError, match="num_experts_per_tok 5: expected 1 to 4"):
        Engine.load(EngineConfig(dtype="float32", model=str(bad), kv_cache_gb=0.01))


def test_the_transformers_fallback_runs_gpt_oss_sinks_through_the_paged_kernels(tmp_path: Path) -> None:
    """model_impl 'transformers': Hugging Face's gpt-oss modules, its sinks passed to batchq's attention."""
    arch, overrides = ARCHS["gpt_oss"]
    path = build_tiny_checkpoint(tmp_path, arch, seed=1, **overrides)
    cfg = EngineConfig(
        dtype="float32", model=str(path), kv_cache_gb=0.01, block_size=8, model_impl="transformers"
    )
    engine = Engine.load(cfg)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = GenerationParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)
    prompts = PROMPTS[:3]
    results = engine.generate(
        [EngineRequest(f"r{i}", params, prompt_token_ids=p) for i, p in enumerate(prompts)]
    )
    ties = [t for i, (p, r) in enumerate(zip(prompts, results, strict=True))
            if (t := check_greedy(i, r.token_ids, *hf_greedy(hf, p, NEW, ignore_eos=True))) is not None]  # fmt: skip
    assert len(ties) <= 1, ties
