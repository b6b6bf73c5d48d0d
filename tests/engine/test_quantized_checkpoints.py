"""Quantised checkpoints load as they are shipped (GPTQ 4/8-bit with and without act-order, AWQ, compressed-
tensors FP8) and compute what the same model computes with its weights dequantised by the format's reference
formula in float32: greedy tokens equal HF `generate` on that model, prefill logits within 1e-4, with the C
kernels (decode stack included) and with torch's. The checkpoints are written by the test
(tests/quant_checkpoints.py), from tiny random models with perturbed norms and biases."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from greedy_parity import check_greedy, hf_greedy
from transformers import AutoModelForCausalLM

from tests.quant_checkpoints import quantise_checkpoint
from tests.tiny_models import build_tiny_checkpoint
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest
from worker.engine_config import EngineConfig

PROMPTS = [[5, 6, 7], list(range(10, 60)), [200, 100] * 30, [42], list(range(3, 100, 2))]
MAX_NEW = 16
CASES = {
    "gptq4": ("llama", {"attention_bias": True}, "gptq", 4, False),
    "gptq4-act-order": ("qwen2", {}, "gptq", 4, True),
    "gptq8": ("llama", {}, "gptq", 8, False),
    "awq": ("qwen3", {"head_dim": 32}, "awq", 4, False),
    "fp8": ("llama", {"tie_word_embeddings": True}, "fp8", 8, False),
    "gptq4-granite": ("granite", {"residual_multiplier": 0.7, "embedding_multiplier": 2.0}, "gptq", 4, False),
    "gptq4-phi3-fused": ("phi3", {}, "gptq", 4, False),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def quantised(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch, overrides, method, bits, act = CASES[request.param]
    src = build_tiny_checkpoint(tmp_path_factory.mktemp("float"), arch, seed=2, **overrides)
    dest = tmp_path_factory.mktemp(request.param)
    ref_state = quantise_checkpoint(src, dest, method, bits, 32, act)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(ref_state, strict=False)
    assert not unexpected and all(m.endswith("lm_head.weight") for m in missing), (missing, unexpected)
    return dest, hf, request.param


@pytest.mark.parametrize("cpu_kernels", ["auto", "torch"])
def test_quantised_checkpoints_compute_their_reference_dequantisation(quantised, cpu_kernels: str) -> None:
    path, hf, name = quantised
    cfg = EngineConfig(
        dtype="float32", model=str(path), kv_cache_gb=0.01, block_size=8, cpu_kernels=cpu_kernels
    )
    engine = Engine.load(cfg)
    model = engine.model_runner.model
    kept = model.quantised_linears()
    # every projection stays quantised (the head is float) where linear.c runs them; for torch's ops they
    # are dequantised at load
    assert len(kept) == (4 * model.spec.num_layers if cpu_kernels == "auto" else 0), name
    if cpu_kernels == "auto" and model.uses_c_linear and not any(lin.in_perm is not None for lin in kept):
        assert engine.model_runner.backend.decode_stack, "quantised weights decode in the C stack"
    reqs = [EngineRequest(f"r{i}", GenerationParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True),
                          prompt_token_ids=p) for i, p in enumerate(PROMPTS)]  # fmt: skip
    results = engine.generate(reqs)
    ties = []
    for i, (prompt, res) in enumerate(zip(PROMPTS, results, strict=True)):
        theirs, logits = hf_greedy(hf, prompt, MAX_NEW, ignore_eos=True)
        tie = check_greedy(i, res.token_ids, theirs, logits)
        if tie is not None:
            ties.append(tie)
    assert len(ties) <= 1, f"{name}: too many near-ties {ties}"
    # prefill logits of one prompt, against HF's on the dequantised model
    engine.add_request(EngineRequest("p", GenerationParams(max_new_tokens=2), prompt_token_ids=PROMPTS[1]))
    engine._intake()
    batch = engine.scheduler.schedule()
    assert batch is not None
    ours = engine.model_runner.compute_logits(batch)[0]
    with torch.no_grad():
        want = hf(torch.tensor([PROMPTS[1]])).logits[0, -1]
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)


def test_act_order_projections_of_one_input_in_different_orders_are_refused(tmp_path: Path) -> None:
    from worker.models.errors import ModelLoadError
    from worker.models.loader import load_model

    src = build_tiny_checkpoint(tmp_path / "float", "llama", seed=2)
    dest = tmp_path / "gptq"
    quantise_checkpoint(src, dest, "gptq", 4, 32, act_order=True, same_input_order=False)
    with pytest.raises(ModelLoadError, match="order their inputs differently"):
        load_model(str(dest), torch.float32, torch.device("cpu"))


def test_an_act_order_module_whose_g_idx_keeps_its_inputs_in_place_loads(tmp_path: Path) -> None:
    from worker.models.loader import load_model

    src = build_tiny_checkpoint(tmp_path / "float", "llama", seed=2)
    dest = tmp_path / "gptq"
    # o_proj's 64 inputs ordered within each half, a group of 32: its g_idx is k // 32
    quantise_checkpoint(src, dest, "gptq", 4, 32, act_order=True, row_shares=2)
    model = load_model(str(dest), torch.float32, torch.device("cpu")).model
    o_proj = model.layers[0].self_attn.o_proj  # type: ignore[union-attr]
    assert torch.equal(o_proj.in_perm, torch.arange(64))


def test_a_quantised_module_missing_a_part_names_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from worker.models.errors import ModelLoadError
    from worker.models.loader import load_model

    src = build_tiny_checkpoint(tmp_path / "float", "llama", seed=2)
    dest = tmp_path / "gptq"
    quantise_checkpoint(src, dest, "gptq", 4, 32)
    sd = load_file(dest / "model.safetensors")
    del sd["model.layers.1.self_attn.o_proj.qzeros"]
    save_file(sd, dest / "model.safetensors")
    with pytest.raises(ModelLoadError) as e:
        load_model(str(dest), torch.float32, torch.device("cpu"))
    assert str(e.value) == (
        f"model {str(dest)!r}: cannot load its weights: quantised module 'model.layers.1.self_attn.o_proj': the "
        "checkpoint holds only its ['g_idx', 'qweight', 'scales']"
    )


def test_a_quantised_checkpoint_is_not_quantised_again(tmp_path: Path) -> None:
    src = build_tiny_checkpoint(tmp_path / "float", "llama", seed=2)
    dest = tmp_path / "awq"
    quantise_checkpoint(src, dest, "awq", 4, 32)
    cfg = EngineConfig(dtype="float32", model=str(dest), kv_cache_gb=0.01, weight_dtype="int8")
    with pytest.raises(ValueError, match="quantised already"):
        Engine.load(cfg)
