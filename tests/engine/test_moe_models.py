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
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest
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
