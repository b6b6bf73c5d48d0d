"""Greedy and logit parity with HF for tiny random Llama / Qwen2 / Qwen3 / Mistral checkpoints.

Each checkpoint goes through the production loader (save_pretrained dir -> Engine.load).
"""

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
from worker.engine.scheduler import ScheduledBatch

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
ARCHS = {
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE, "attention_bias": True}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "mistral": ("mistral", {"sliding_window": 4096}),
}
PROMPTS = [[5, 6, 7], list(range(10, 60)), [200, 100] * 40, [42], list(range(3, 120, 2))]
MAX_NEW = [20, 7, 33, 12, 25]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    arch, overrides = ARCHS[request.param]
    path = build_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)
    return path, request.param


def greedy(max_new: int) -> GenerationParams:
    return GenerationParams(temperature=0, max_new_tokens=max_new)


def test_greedy_matches_hf_generate_in_one_mixed_batch(tiny: tuple[Path, str]) -> None:
    path, name = tiny
    engine = Engine.load(EngineConfig(dtype="float32", model=str(path), kv_cache_gb=0.01, block_size=8))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reqs = [
        EngineRequest(f"r{i}", greedy(n), prompt_token_ids=p)
        for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW, strict=True))
    ]
    results = engine.generate(reqs)
    ties = []
    for i, (prompt, res) in enumerate(zip(PROMPTS, results, strict=True)):
        theirs, logits = hf_greedy(hf, prompt, MAX_NEW[i])
        tie = check_greedy(i, res.token_ids, theirs, logits)
        if tie is not None:
            ties.append(tie)
        assert res.prompt_tokens == len(prompt) and res.completion_tokens == len(res.token_ids)
    assert len(ties) <= 1, f"{name}: too many near-ties {ties}"


def test_prefill_and_decode_logits_match_hf(tiny: tuple[Path, str]) -> None:
    path, _ = tiny
    engine = Engine.load(EngineConfig(dtype="float32", model=str(path), kv_cache_gb=0.01, block_size=8))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = [list(range(10, 47)), [7, 8, 9, 10, 11]]
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"p{i}", greedy(5), prompt_token_ids=p))
    engine._intake()
    prefill = engine.scheduler.schedule()
    assert prefill is not None and prefill.phase == "prefill"
    ours = engine.model_runner.compute_logits(prefill)  # [2, vocab]
    assert engine.scheduler.computed(prefill) == prefill.seqs
    nxt = ours.argmax(-1).tolist()
    for seq, t in zip(prefill.seqs, nxt, strict=True):
        seq.output_ids.append(t)
    decode = engine.scheduler.schedule()
    assert decode is not None and decode.phase == "decode"
    ours_decode = engine.model_runner.compute_logits(
        ScheduledBatch("decode", decode.seqs, decode.block_tables)
    )
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = hf(torch.tensor([[*p, nxt[i]]])).logits[0]  # [len + 1, vocab]
            torch.testing.assert_close(ours[i], ref[-2], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(ours_decode[i], ref[-1], rtol=1e-4, atol=1e-4)
