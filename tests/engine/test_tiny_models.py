"""Greedy and logit parity with HF for tiny random Llama / Qwen2 / Qwen3 / Mistral / Granite / OLMo 2 /
Phi-3 / Gemma 2 / Gemma 3 checkpoints, and for the new families label scores and token logprobs too.

Each checkpoint goes through the production loader (save_pretrained dir -> Engine.load).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from greedy_parity import check_greedy, hf_greedy

from tests.tiny_models import build_tiny_checkpoint, build_tiny_gemma3_image_text, hf_reference
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest
from worker.engine.scheduler import ScheduledBatch
from worker.engine_config import EngineConfig
from worker.models.transformers_model import TransformersModel

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
GRANITE = {
    "embedding_multiplier": 2.0,
    "residual_multiplier": 0.7,
    "attention_multiplier": 0.4,
    "logits_scaling": 1.3,
}


def longrope(rotary_dims: int, threshold: int) -> dict[str, object]:
    """Phi-3's LongRoPE: a short and a long factor per rotary frequency."""
    n = rotary_dims // 2
    return {
        "original_max_position_embeddings": threshold,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(n)],
            "long_factor": [1.0 + 0.6 * i for i in range(n)],
        },
    }


# The other rope types transformers defines, each read from the config as Hugging Face computes it (its
# rotary module's inv_freq and attention scaling): dynamic NTK rescales only past max_position_embeddings,
# which is the context, so within it a sequence rotates as with the default.
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0}
DYNAMIC_ROPE = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}

# Gemma 2: query_pre_attn_scalar's softmax scale (not head_dim's), attention-logit and final-logit soft-caps
# low enough to bend these scores and logits, layers alternately windowed (the window shorter than most
# prompts). Gemma 3's text model: per-head (1 + w) q/k norms, two sliding layers to a global one, the local
# rotary base (rope_local_base_freq) apart from the global one, which a linear scaling stretches. Tied, a
# tiny Gemma repeats its last token (the scaled embedding dominates h . E) unless its weights are small.
# Their norm weights are random around 0 (tiny_models adds noise to Hugging Face's zeros): the norms scale
# by 1 + w.
GEMMA2 = {"head_dim": 16, "query_pre_attn_scalar": 64, "attn_logit_softcapping": 4.0,
          "final_logit_softcapping": 3.0, "sliding_window": 12}  # fmt: skip
GEMMA3 = {"head_dim": 16, "query_pre_attn_scalar": 64, "sliding_window": 10, "num_hidden_layers": 3,
          "sliding_window_pattern": 3, "rope_local_base_freq": 100.0,
          "rope_scaling": {"rope_type": "linear", "factor": 2.0}}  # fmt: skip

ARCHS = {
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE, "attention_bias": True}),
    "llama-linear-rope": ("llama", {"rope_parameters": LINEAR_ROPE}),
    "llama-dynamic-rope": ("llama", {"rope_parameters": DYNAMIC_ROPE}),
    "qwen2-yarn-rope": ("qwen2", {"rope_parameters": YARN_ROPE}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-gelu": ("llama", {"hidden_act": "gelu"}),  # the exact GELU: its own MLP activation
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "mistral": ("mistral", {"sliding_window": 16}),  # every layer windowed, most prompts longer than it
    # Qwen2's sliding layers from max_window_layers on: layer 0 full, layers 1-2 windowed
    "qwen2-sliding": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1, "num_hidden_layers": 3},
    ),
    "granite": ("granite", GRANITE),
    "granite-tied": ("granite", {**GRANITE, "tie_word_embeddings": True}),
    "olmo2": ("olmo2", {"attention_bias": True}),
    "phi3": ("phi3", {}),
    # the threshold sits past every test sequence: short factors throughout, as Hugging Face rotates them
    "phi3-longrope": ("phi3", longrope(16, 128)),
    "phi4-mini-like": (
        "phi3",
        {**longrope(12, 128), "partial_rotary_factor": 0.75, "tie_word_embeddings": True},
    ),
    "gemma2": ("gemma2", {**GEMMA2, "attention_bias": True}),
    "gemma3": ("gemma3", GEMMA3),
    "gemma3-tied": ("gemma3", {**GEMMA3, "tie_word_embeddings": True, "initializer_range": 0.02}),
}
NEW_FAMILIES = [
    "gemma2",
    "gemma3",
    "granite",
    "granite-tied",
    "olmo2",
    "phi3",
    "phi3-longrope",
    "phi4-mini-like",
]
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
    hf = hf_reference(path)
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
    hf = hf_reference(path)
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


@pytest.fixture(scope="module", params=NEW_FAMILIES)
def new_family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    arch, overrides = ARCHS[request.param]
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp(request.param), arch, seed=3, **overrides
    ), request.param


@pytest.mark.parametrize("cpu_kernels", ["auto", "torch"])
def test_label_scores_and_token_logprobs_match_hf(new_family: tuple[Path, str], cpu_kernels: str) -> None:
    from tests.engine.test_labeling import check_labels_and_logprobs_match_hf

    path, _ = new_family
    cfg = EngineConfig(
        dtype="float32", model=str(path), kv_cache_gb=0.01, block_size=8, cpu_kernels=cpu_kernels
    )
    engine = Engine.load(cfg)
    check_labels_and_logprobs_match_hf(engine, hf_reference(path))


# What each family's decode steps run on, with the C kernels: the decode stack where decode_stack.c computes
# the family's structure (Granite's multipliers are folded into weights and scales it already takes), layer
# by layer where it does not.
STACK = {"granite": True, "granite-tied": True, "olmo2": False, "phi3": True, "phi3-longrope": True,
         "phi4-mini-like": False, "gemma2": True, "gemma3": True}  # fmt: skip


def test_each_family_decodes_on_the_path_the_backend_names(new_family: tuple[Path, str]) -> None:
    path, name = new_family
    engine = Engine.load(EngineConfig(dtype="float32", model=str(path), kv_cache_gb=0.01, block_size=8))
    backend, model = engine.model_runner.backend, engine.model_runner.model
    if backend.linear.name != "c":
        pytest.skip("no C compiler here")
    assert backend.decode_stack == STACK[name]
    engine.generate([EngineRequest("r", greedy(4), prompt_token_ids=[5, 6, 7])])
    assert (model._stack is not None and model._stack[1] is not None) == STACK[name]
    if not STACK[name]:
        assert backend.stack_refused is not None and "decode layer by layer" in backend.summary
        assert model.decode_stack_unsupported == backend.stack_refused


def test_longrope_positions_past_the_threshold_take_the_long_factors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A sequence that grows past original_max_position_embeddings keeps its cached K, each later position
    rotated by the long factors (loader._long_rope): Hugging Face's model stepped token by token over its own
    cache computes the same."""
    path = build_tiny_checkpoint(tmp_path, "phi3", seed=3, **longrope(16, 24))
    hf = hf_reference(path)
    prompt, new = list(range(10, 30)), 12  # 20 tokens, then 12 more: the threshold passed at the 5th
    for cpu_kernels in ("auto", "torch"):
        cfg = EngineConfig(
            dtype="float32", model=str(path), kv_cache_gb=0.01, block_size=8, cpu_kernels=cpu_kernels
        )
        with caplog.at_level(logging.WARNING, logger="worker.models.loader"):
            engine = Engine.load(cfg)
        assert "LongRoPE: exact for sequences of up to 24 tokens" in caplog.text
        params = GenerationParams(max_new_tokens=new, temperature=0.0, logprobs=True, ignore_eos=True)
        res = engine.generate([EngineRequest("r", params, prompt_token_ids=prompt)])[0]
        assert res.logprobs is not None and len(res.token_ids) == new
        with torch.no_grad():
            out = hf(torch.tensor([prompt]), use_cache=True)
            for i, tok in enumerate(res.token_ids):
                row = torch.log_softmax(out.logits[0, -1], dim=-1)
                assert abs(res.logprobs[i].logprob - float(row[tok])) < 1e-4, (cpu_kernels, i)
                assert tok == int(row.argmax())
                position = torch.tensor([[len(prompt) + i]])
                out = hf(torch.tensor([[tok]]), past_key_values=out.past_key_values, position_ids=position)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_runs_natively_and_each_of_its_rules_changes_hf_logits(
    arch: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Gemma 2 and 3 load on the native path (the worker logs it), and the parity tests above can fail:
    without any one of the rules the decoder computes (the soft-caps, query_pre_attn_scalar's scale, the
    (1 + w) norms, the embedding normalizer, Gemma 3's local rotary base) Hugging Face's own model gives
    these prompts other logits."""
    overrides = GEMMA2 if arch == "gemma2" else GEMMA3
    path = build_tiny_checkpoint(tmp_path, arch, **overrides)
    with caplog.at_level(logging.INFO, logger="worker.models.loader"):
        engine = Engine.load(EngineConfig(dtype="float32", model=str(path), kv_cache_gb=0.01, block_size=8))
    assert f"native decoder: {'gemma3_text' if arch == 'gemma3' else arch}" in caplog.text
    assert not isinstance(engine.model_runner.model, TransformersModel)
    hf = hf_reference(path)
    m, ids = hf.model, torch.tensor([PROMPTS[2]])  # 80 tokens, past every window
    attn = [layer.self_attn for layer in m.layers]
    scale, local = attn[0].scaling, getattr(m.rotary_emb, "sliding_attention_inv_freq", None)
    local = None if local is None else local.clone()
    rules: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "query_pre_attn_scalar": (lambda: [setattr(a, "scaling", 16**-0.5) for a in attn],
                                  lambda: [setattr(a, "scaling", scale) for a in attn]),
        "1 + w": (lambda: m.norm.weight.add_(1.0), lambda: m.norm.weight.sub_(1.0)),
        "normalizer": (lambda: m.embed_tokens.embed_scale.fill_(1.0),
                       lambda: m.embed_tokens.embed_scale.fill_(64**0.5)),
    }  # fmt: skip
    if arch == "gemma2":
        rules["attention softcap"] = (
            lambda: [setattr(a, "attn_logit_softcapping", None) for a in attn],
            lambda: [setattr(a, "attn_logit_softcapping", GEMMA2["attn_logit_softcapping"]) for a in attn],
        )
        rules["final softcap"] = (
            lambda: setattr(hf.config, "final_logit_softcapping", None),
            lambda: setattr(hf.config, "final_logit_softcapping", GEMMA2["final_logit_softcapping"]),
        )
    else:
        assert local is not None
        rules["local rotary base"] = (
            lambda: m.rotary_emb.sliding_attention_inv_freq.copy_(m.rotary_emb.full_attention_inv_freq),
            lambda: m.rotary_emb.sliding_attention_inv_freq.copy_(local),
        )
    with torch.no_grad():
        base = hf(ids).logits
        for rule, (undo, redo) in rules.items():
            undo()
            assert float((hf(ids).logits - base).abs().max()) > 0.05, (arch, rule)
            redo()
            assert torch.equal(hf(ids).logits, base), (arch, rule)


def test_a_gemma3_image_text_checkpoint_runs_its_text_decoder_natively(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Gemma 3's image-text checkpoints (model_type gemma3) serve text: the decoder is their text_config,
    its tensors read from under language_model. (the vision tower's left unread), tied as the top-level
    config says; greedy tokens and logprobs equal Hugging Face's image-text model on text-only prompts."""
    from transformers import Gemma3ForConditionalGeneration

    path = build_tiny_gemma3_image_text(tmp_path, **{**GEMMA3, "initializer_range": 0.02})
    with caplog.at_level(logging.INFO, logger="worker.models.loader"):
        engine = Engine.load(EngineConfig(dtype="float32", model=str(path), kv_cache_gb=0.01, block_size=8))
    assert "native decoder: gemma3 (its text_config, gemma3_text)" in caplog.text
    model = engine.model_runner.model
    assert not isinstance(model, TransformersModel) and model.spec.tie_embeddings
    assert model.layer_windows == (10, 10, None)
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    params = GenerationParams(temperature=0, max_new_tokens=16, ignore_eos=True, logprobs=True)
    results = engine.generate(
        [EngineRequest(f"r{i}", params, prompt_token_ids=p) for i, p in enumerate(PROMPTS)]
    )
    for i, (prompt, res) in enumerate(zip(PROMPTS, results, strict=True)):
        theirs, logits = hf_greedy(hf, prompt, 16, ignore_eos=True)
        assert check_greedy(i, res.token_ids, theirs, logits) is None
        assert res.logprobs is not None
        for step, (lp, row) in enumerate(zip(res.logprobs, logits, strict=False)):
            want = float(torch.log_softmax(row.float(), -1)[res.token_ids[step]])
            assert abs(lp.logprob - want) < 1e-4, (i, step)
    assert len({t for r in results for t in r.token_ids}) > 5  # not one token repeated: a test that can fail
