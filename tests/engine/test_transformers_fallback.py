"""The transformers fallback (models/transformers_model.py): families without a native path (Cohere, Starcoder2,
Cohere 2 with its interleaved sliding windows) run Hugging Face's own layers over batchq's paged cache, exact
against Hugging Face in float32 and continuously batched, prefix cache included (a shared prefix longer than
the windows); Llama, and Gemma 2 with its soft-caps and interleaved windows, give the same tokens on either
path; what the fallback cannot compute exactly is refused at load, in one line.

Each checkpoint goes through the production loader (save_pretrained dir -> Engine.load).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from greedy_parity import check_greedy, hf_greedy

from tests.tiny_models import build_tiny_checkpoint, hf_reference
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest
from worker.engine.scheduler import ScheduledBatch
from worker.engine_config import EngineConfig
from worker.models.errors import ModelLoadError
from worker.models.resolve import check_model_reference
from worker.models.transformers_model import TransformersModel

# Cohere: LayerNorm without bias, interleaved rotary, parallel attention and MLP, logits times logit_scale,
# per-head q/k norms. Starcoder2: biased LayerNorms and projections, a GELU MLP.
FAMILIES = {
    "cohere": ("cohere", {"logit_scale": 0.5, "use_qk_norm": True}),
    "starcoder2": ("starcoder2", {}),
    # Cohere 2: layers alternately windowed (rotary in the windowed ones only), the window shorter than
    # most prompts here
    "cohere2": ("cohere2", {"sliding_window": 12, "sliding_window_pattern": 2, "logit_scale": 0.5}),
}
# Gemma 2 (native, tests/engine/test_tiny_models.py) through the fallback too: a softmax scale of
# query_pre_attn_scalar ** -0.5, attention-logit softcapping low enough to bend these scores, a final logit
# softcap, layers alternately windowed
GEMMA2 = (
    "gemma2",
    {"head_dim": 16, "query_pre_attn_scalar": 64, "attn_logit_softcapping": 4.0, "sliding_window": 12},
)
SHARED = list(range(10, 58))  # six blocks of 8: what the second batch's prompts find in the prefix cache
PROMPTS = [[5, 6, 7], [*SHARED, 3, 4], list(range(10, 60)), [200, 100] * 20, [42], [*SHARED, 77]]
NEW = 16


def load(path: Path, **settings: object) -> Engine:
    return Engine.load(
        EngineConfig(dtype="float32", model=str(path), kv_cache_gb=0.01, block_size=8, **settings)  # type: ignore[arg-type]
    )


def greedy(max_new: int = NEW, **kw: object) -> GenerationParams:
    return GenerationParams(temperature=0, max_new_tokens=max_new, ignore_eos=True, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    arch, overrides = FAMILIES[request.param]
    return build_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides), request.param


def test_greedy_matches_hf_generate_in_mixed_batches_over_the_prefix_cache(
    family: tuple[Path, str], caplog: pytest.LogCaptureFixture
) -> None:
    path, name = family
    with caplog.at_level(logging.INFO, logger="worker.models.loader"):
        # a small token budget: prompts go in chunks, beside the decode rows of the others (mixed steps)
        engine = load(path, max_num_batched_tokens=40, max_num_seqs=8)
    assert f"transformers fallback: {name}" in caplog.text
    assert isinstance(engine.model_runner.model, TransformersModel)
    backend = engine.model_runner.backend
    assert backend.linear.name == "torch" and not backend.decode_stack
    hf = hf_reference(path)
    engine.generate([EngineRequest("warm", greedy(2), prompt_token_ids=SHARED)])
    cached = engine.counters.cached_prompt_tokens
    reqs = [EngineRequest(f"r{i}", greedy(), prompt_token_ids=p) for i, p in enumerate(PROMPTS)]
    results = engine.generate(reqs)
    assert engine.counters.cached_prompt_tokens - cached >= 2 * len(SHARED) - 16  # both extensions hit
    for i, (prompt, res) in enumerate(zip(PROMPTS, results, strict=True)):
        theirs, logits = hf_greedy(hf, prompt, NEW)
        assert check_greedy(i, res.token_ids, theirs, logits) is None, name
        assert len(res.token_ids) == NEW


@pytest.mark.parametrize("cpu_kernels", ["auto", "torch"])
def test_label_scores_and_token_logprobs_match_hf(family: tuple[Path, str], cpu_kernels: str) -> None:
    from tests.engine.test_labeling import check_labels_and_logprobs_match_hf

    path, _ = family
    engine = load(path, cpu_kernels=cpu_kernels)
    check_labels_and_logprobs_match_hf(engine, hf_reference(path))


def test_llama_gives_the_same_tokens_and_logits_through_the_fallback_as_natively(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path, "llama", attention_bias=True)
    native, fallback = load(path, model_impl="native"), load(path, model_impl="transformers")
    assert not isinstance(native.model_runner.model, TransformersModel)
    assert isinstance(fallback.model_runner.model, TransformersModel)
    assert native.fingerprint != fallback.fingerprint  # results cached by one are not served by the other
    reqs = [EngineRequest(f"r{i}", greedy(), prompt_token_ids=p) for i, p in enumerate(PROMPTS)]
    a, b = native.generate(reqs), fallback.generate(reqs)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    logits = []
    for engine in (native, fallback):  # one prefill step, then one decode step, of the same two prompts
        for i, p in enumerate(PROMPTS[1:3]):
            engine.add_request(EngineRequest(f"p{i}", greedy(5), prompt_token_ids=p))
        engine._intake()
        prefill = engine.scheduler.schedule()
        assert prefill is not None and prefill.phase == "prefill"
        first = engine.model_runner.compute_logits(prefill)
        engine.scheduler.computed(prefill)
        for seq, t in zip(prefill.seqs, first.argmax(-1).tolist(), strict=True):
            seq.output_ids.append(t)
        decode = engine.scheduler.schedule()
        assert decode is not None and decode.phase == "decode"
        logits.append(
            (
                first,
                engine.model_runner.compute_logits(
                    ScheduledBatch("decode", decode.seqs, decode.block_tables)
                ),
            )
        )
    for ours, theirs in zip(logits[0], logits[1], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_an_fp8_cache_calibrates_through_the_fallback(tmp_path: Path) -> None:
    """FP8 calibration observes each layer's K/V through the attention function: the scales equal the native
    path's, and the tokens too."""
    path = build_tiny_checkpoint(tmp_path, "llama")
    engines = [load(path, model_impl=impl, kv_cache_dtype="fp8_e4m3") for impl in ("native", "transformers")]
    native_model, fallback_model = (e.model_runner.model for e in engines)
    assert isinstance(fallback_model, TransformersModel) and not isinstance(native_model, TransformersModel)
    native_scales = [(a.k_scale, a.v_scale) for a in native_model.attentions()]
    for (k0, v0), (k1, v1) in zip(native_scales, fallback_model._scales, strict=True):
        assert k1 == pytest.approx(k0, rel=1e-5) and v1 == pytest.approx(v0, rel=1e-5)
    reqs = [EngineRequest(f"r{i}", greedy(), prompt_token_ids=p) for i, p in enumerate(PROMPTS)]
    a, b = (e.generate(reqs) for e in engines)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_what_the_fallback_cannot_run_exactly_is_refused_in_one_line(tmp_path: Path) -> None:
    # an encoder-decoder, refused before anything loads
    t5 = tmp_path / "t5"
    t5.mkdir()
    config = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True}
    (t5 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 't5' .*an encoder-decoder") as e:
        check_model_reference(str(t5))
    assert "\n" not in str(e.value)
    # a multimodal model's head, of a family batchq does not run natively
    (t5 / "config.json").write_text(
        json.dumps({"model_type": "paligemma", "architectures": ["PaliGemmaForConditionalGeneration"]})
    )
    with pytest.raises(ModelLoadError, match=r"not a decoder-only \*ForCausalLM"):
        check_model_reference(str(t5))


def test_settings_the_fallback_cannot_honour_are_refused(family: tuple[Path, str]) -> None:
    path, name = family
    with pytest.raises(ModelLoadError, match=rf"model_impl 'native': no native path for .*{name}|activation"):
        load(path, model_impl="native")
    with pytest.raises(
        ValueError, match=r"weight_dtype .*transformers fallback runs Hugging Face's own linear"
    ):
        load(path, weight_dtype="int8")


def test_a_bfloat16_model_passes_the_load_check_and_serves(family: tuple[Path, str]) -> None:
    path, _ = family
    engine = Engine.load(EngineConfig(dtype="bfloat16", model=str(path), kv_cache_gb=0.01, block_size=8))
    assert engine.model_runner.model.dtype == torch.bfloat16
    results = engine.generate(
        [EngineRequest(f"r{i}", greedy(), prompt_token_ids=p) for i, p in enumerate(PROMPTS)]
    )
    assert all(len(r.token_ids) == NEW for r in results)


def test_every_layer_the_config_masks_with_a_window_passes_that_window(tmp_path: Path) -> None:
    """The windows Cohere 2's modules pass (recorded on the load's check) are the ones its config's mask
    names; a config whose mask windowed a layer its module attends to in full would be refused, as would
    layer types batchq's attention does not compute."""
    import copy

    from worker.models.transformers_model import check_windows

    arch, overrides = FAMILIES["cohere2"]
    engine = load(build_tiny_checkpoint(tmp_path, arch, **overrides))
    model = engine.model_runner.model
    assert isinstance(model, TransformersModel) and model.layer_windows == (12, None)
    cfg = model.hf.config
    assert check_windows(model, cfg) is None
    both = copy.deepcopy(cfg)
    both.layer_types = ["sliding_attention", "sliding_attention"]
    assert check_windows(model, both) == (
        "layer 1's mask has a sliding window of 12 tokens but its attention module passes None to the "
        "attention function"
    )
    both.layer_types = ["sliding_attention", "chunked_attention"]
    assert "layer types ['chunked_attention']" in str(check_windows(model, both))


def test_gemma2_gives_hf_tokens_through_the_fallback_as_natively(tmp_path: Path) -> None:
    """Gemma 2's soft-caps and interleaved windows through Hugging Face's own layers (model_impl
    'transformers'): the tokens Hugging Face generates, the native decoder's too, over the prefix cache."""
    arch, overrides = GEMMA2
    path = build_tiny_checkpoint(tmp_path, arch, **overrides)
    native, fallback = load(path, model_impl="native"), load(path, model_impl="transformers")
    assert isinstance(fallback.model_runner.model, TransformersModel)
    assert fallback.model_runner.model.layer_windows == (12, None)
    hf = hf_reference(path)
    for engine in (native, fallback):
        engine.generate([EngineRequest("warm", greedy(2), prompt_token_ids=SHARED)])
    reqs = [EngineRequest(f"r{i}", greedy(), prompt_token_ids=p) for i, p in enumerate(PROMPTS)]
    a, b = native.generate(reqs), fallback.generate(reqs)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert fallback.counters.cached_prompt_tokens >= 2 * len(SHARED) - 16
    for i, (prompt, res) in enumerate(zip(PROMPTS, b, strict=True)):
        theirs, logits = hf_greedy(hf, prompt, NEW)
        assert check_greedy(i, res.token_ids, theirs, logits) is None
