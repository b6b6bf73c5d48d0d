"""Embedding requests against Hugging Face's hidden states, on a tiny random Qwen3 (random norms and biases).

The reference is HF's float32 forward of each input alone: `hidden_states[-1]` (which transformers
makes the output after the final norm, `last_hidden_state`), pooled at the last token or by the mean,
cut to `dimensions` and L2-normalised. The engine's vectors must equal it within 1e-5 whatever else
shares the step: generation, prefix-cache hits, prompts chunked over several steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.tiny_models import build_tiny_checkpoint
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.pooling import model_pooling
from worker.engine.request import EmbeddingInputs, EngineRequest, EngineResult
from worker.engine_config import EngineConfig

TOL = 1e-5
TEXTS = ["the cat sat on the mat", "a", "labels for a dataset, " * 6, "ünïcödé ✓ text"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=5)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def engine_for(path: Path, **kw: object) -> Engine:
    cfg = dict(model=str(path), dtype="float32", kv_cache_gb=0.02, block_size=8, max_num_batched_tokens=64)
    cfg.update(kw)
    return Engine.load(EngineConfig(**cfg))  # type: ignore[arg-type]


@torch.no_grad()
def hf_vector(hf, ids: list[int], pooling: str, dims: int | None = None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = hf(torch.tensor([ids]), output_hidden_states=True)
    last = out.hidden_states[-1][0].float()  # [len, hidden]
    assert torch.equal(last, hf.model(torch.tensor([ids])).last_hidden_state[0].float())  # after the norm
    vec = last[-1] if pooling == "last" else last.mean(0)
    return torch.nn.functional.normalize(vec[:dims], dim=-1)


def embed(
    rid: str, inputs: list[str] | list[list[int]], dims: int | None = None, **kw: object
) -> EngineRequest:
    params = GenerationParams(max_new_tokens=1, **kw)  # type: ignore[arg-type]
    return EngineRequest(request_id=rid, params=params, embedding=EmbeddingInputs(inputs, dims))


def check(
    engine: Engine, hf, res: EngineResult, inputs: list[str], pooling: str, dims: int | None = None
) -> None:  # type: ignore[no-untyped-def]
    assert res.error is None and res.finish_reason == "stop", res.error
    assert res.embeddings is not None and len(res.embeddings) == len(inputs)
    total = 0
    for text, got in zip(inputs, res.embeddings, strict=True):
        ids = engine.tokenizer(text).input_ids
        total += len(ids)
        want = hf_vector(hf, ids, pooling, dims)
        assert len(got) == (dims or hf.config.hidden_size)
        assert (torch.tensor(got) - want).abs().max().item() < TOL, text
        assert abs(torch.tensor(got).norm().item() - 1.0) < 1e-5
    assert res.prompt_tokens == total and res.completion_tokens == 0 and res.token_ids == []


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_hf_pooled_hidden_states_beside_generation(qwen3, pooling: str) -> None:
    path, hf = qwen3
    engine = engine_for(path, embedding_pooling=pooling)
    gen = EngineRequest(
        request_id="gen", params=GenerationParams(max_new_tokens=12, temperature=0.0), prompt="continue this"
    )
    reqs = [embed("e-list", TEXTS), gen, embed("e-one", [TEXTS[2]]), embed("e-cut", TEXTS[:2], dims=16)]
    out = {r.request_id: r for r in engine.generate(reqs)}
    check(engine, hf, out["e-list"], TEXTS, pooling)
    check(engine, hf, out["e-one"], [TEXTS[2]], pooling)
    check(engine, hf, out["e-cut"], TEXTS[:2], pooling, dims=16)
    # the generation beside them is HF's greedy continuation
    ids = engine.tokenizer("continue this").input_ids
    want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :].tolist()
    assert out["gen"].token_ids == want[: len(out["gen"].token_ids)]
    assert engine.block_manager.num_used == 0, "every input's blocks go back once it is pooled"
    engine.scheduler.check_invariants()


def test_last_token_pooling_reads_the_prefix_cache_and_mean_pooling_computes_every_token(qwen3) -> None:
    path, hf = qwen3
    text = "a shared prefix that fills several blocks of eight tokens, then ends"
    for pooling, cached in (("last", True), ("mean", False)):
        engine = engine_for(path, embedding_pooling=pooling)
        first = engine.generate([embed("a", [text])])[0]
        again = engine.generate([embed("b", [text])])[0]
        assert first.cached_tokens == 0
        assert (again.cached_tokens > 0) == cached, (pooling, again.cached_tokens)
        check(engine, hf, again, [text], pooling)
        assert (torch.tensor(first.embeddings) - torch.tensor(again.embeddings)).abs().max().item() < TOL


def test_a_long_input_is_pooled_over_chunked_steps(qwen3) -> None:
    path, hf = qwen3
    text = "chunk " * 40  # 240 tokens over steps of 32
    for pooling in ("last", "mean"):
        engine = engine_for(path, embedding_pooling=pooling, max_num_batched_tokens=32, max_num_seqs=4)
        res = engine.generate([embed("long", [text, "short"])])[0]
        check(engine, hf, res, [text, "short"], pooling)
        assert engine.counters.prefill_steps >= 240 // 32


def test_token_id_inputs_and_truncation(qwen3) -> None:
    path, hf = qwen3
    engine = engine_for(path, max_model_len=32)
    res = engine.generate([embed("ids", [[5, 6, 7, 8], list(range(3, 60))], truncate_prompt="left")])[0]
    assert res.embeddings is not None
    for ids, got in zip([[5, 6, 7, 8], list(range(3, 60))[-32:]], res.embeddings, strict=True):
        assert (torch.tensor(got) - hf_vector(hf, ids, "last")).abs().max().item() < TOL
    assert res.prompt_tokens == 4 + 32


def test_bad_embedding_requests_fail_alone_with_a_clear_error(qwen3) -> None:
    path, _ = qwen3
    engine = engine_for(path, max_model_len=32)
    out = engine.generate([
        embed("wide", ["x"], dims=65),
        embed("long", ["ok", "y" * 40]),
        embed("vocab", [[1, 2, 10_000]]),
        embed("fine", ["fine"]),
    ])  # fmt: skip
    by = {r.request_id: r for r in out}
    assert by["wide"].error is not None and "dimensions is 65" in by["wide"].error.message
    assert by["long"].error is not None and by["long"].error.type == "prompt_too_long"
    assert "input 1 has 40 tokens" in by["long"].error.message
    assert by["vocab"].error is not None and "input 0: token ids must lie in" in by["vocab"].error.message
    assert by["fine"].embeddings is not None
    assert engine.block_manager.num_used == 0


def test_timeout_and_cancel_end_every_input_of_the_request(qwen3) -> None:
    path, _ = qwen3
    engine = engine_for(path, max_num_batched_tokens=16, max_num_seqs=2)
    engine.add_request(embed("slow", ["word " * 30, "word " * 30, "word " * 30]))
    engine.add_request(embed("gone", ["word " * 30, "another"]))
    engine.step()
    engine.cancel("gone")
    results = engine.step()
    assert [(r.request_id, r.finish_reason, r.embeddings) for r in results] == [("gone", "cancelled", None)]
    engine.add_request(embed("late", ["word " * 30], timeout_s=1e-9))
    done = {}
    while engine.has_work():
        done.update({r.request_id: r for r in engine.step()})
    assert done["late"].finish_reason == "timeout" and done["late"].embeddings is None
    assert done["slow"].finish_reason == "stop" and done["slow"].embeddings is not None
    assert engine.block_manager.num_used == 0 and not engine.scheduler.running


def test_pooling_comes_from_a_sentence_transformers_config(tmp_path: Path) -> None:
    assert model_pooling(str(tmp_path), "auto").pooling == "last"
    assert model_pooling(str(tmp_path), "mean").pooling == "mean"
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    modes = {
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_lasttoken": False,
    }
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    assert model_pooling(str(tmp_path), "auto").pooling == "mean"
    assert model_pooling(str(tmp_path), "last").pooling == "last"  # the setting wins
    modes.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    cls = model_pooling(str(tmp_path), "auto")
    assert cls.pooling is None and "not one batchq computes" in cls.refused
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    (tmp_path / "modules.json").write_text(json.dumps([*modules, dense]))
    assert "Dense" in model_pooling(str(tmp_path), "auto").refused


def test_a_checkpoint_with_mean_pooling_config_embeds_by_the_mean(qwen3, tmp_path: Path) -> None:
    path, hf = qwen3
    import shutil

    ckpt = Path(shutil.copytree(path, tmp_path / "st"))
    (ckpt / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))  # fmt: skip
    (ckpt / "1_Pooling").mkdir()
    (ckpt / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    engine = engine_for(ckpt)
    check(engine, hf, engine.generate([embed("m", TEXTS[:2])])[0], TEXTS[:2], "mean")


def test_the_transformers_fallback_embeds_as_hf_does(qwen3) -> None:
    path, hf = qwen3
    engine = engine_for(path, model_impl="transformers")
    gen = EngineRequest(
        request_id="g", params=GenerationParams(max_new_tokens=4, temperature=0.0), prompt="hi"
    )
    out = {r.request_id: r for r in engine.generate([embed("e", TEXTS, dims=32), gen])}
    check(engine, hf, out["e"], TEXTS, "last", dims=32)
    assert out["g"].finish_reason in ("eos", "length")


@pytest.mark.parametrize("tied", [True, False])
def test_a_bare_decoder_checkpoint_embeds_as_qwen3_embedding_ships_it(tmp_path: Path, tied: bool) -> None:
    """Qwen3-Embedding's files hold the bare decoder (`embed_tokens.weight`, `layers.N...`, `norm.weight`,
    no `model.` prefix), with its sentence-transformers config; the 8B one also has no LM head though its
    config does not tie one. Both load; the headless one answers embeddings only."""
    from safetensors import safe_open
    from transformers import AutoModel

    from tests.tiny_models import byte_tokenizer, perturb, tiny_config

    torch.manual_seed(7)
    bare = AutoModel.from_config(tiny_config("qwen3", tie_word_embeddings=tied), dtype=torch.float32)
    perturb(bare)
    bare.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "embed_tokens.weight" in names and not any(n.startswith(("model.", "lm_head")) for n in names)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))  # fmt: skip
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))

    engine = engine_for(tmp_path)
    gen = EngineRequest(request_id="g", params=GenerationParams(max_new_tokens=3), prompt="hi")
    out = {r.request_id: r for r in engine.generate([embed("e", TEXTS), gen])}
    assert out["e"].embeddings is not None
    with torch.no_grad():
        ref = AutoModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
        for text, got in zip(TEXTS, out["e"].embeddings, strict=True):
            ids = engine.tokenizer(text).input_ids
            want = torch.nn.functional.normalize(ref(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
            assert (torch.tensor(got) - want).abs().max().item() < TOL
    if tied:
        assert out["g"].error is None
    else:
        assert out["g"].error is not None and out["g"].error.type == "unsupported"
        assert "without an LM head" in out["g"].error.message


def test_a_preempted_input_is_pooled_afresh_when_it_resumes(qwen3) -> None:
    path, hf = qwen3
    text = "resume " * 20  # 140 tokens, chunks of 16
    engine = engine_for(path, embedding_pooling="mean", max_num_batched_tokens=16, max_num_seqs=2)
    engine.add_request(embed("p", [text]))
    for _ in range(3):
        engine.step()
    (seq,) = engine.scheduler.running
    assert seq.pooled is not None and 0 < seq.num_computed < seq.prompt_len
    engine.scheduler.preempt(seq)  # as when the pool runs out: its blocks go back, it resumes from scratch
    assert seq.pooled is None
    done = []
    while engine.has_work():
        done += engine.step()
    check(engine, hf, done[0], [text], "mean")


def test_an_engine_error_fails_each_embedding_request_once(qwen3) -> None:
    from worker.engine.request import EngineError

    path, _ = qwen3
    engine = engine_for(path, max_num_batched_tokens=16, max_num_seqs=4)
    engine.add_request(embed("a", ["word " * 20, "word " * 20]))
    engine.add_request(EngineRequest(request_id="g", params=GenerationParams(max_new_tokens=4), prompt="x"))
    engine.step()
    results = engine.abort_all(EngineError("engine_error", "boom"))
    assert sorted((r.request_id, r.finish_reason) for r in results) == [("a", "error"), ("g", "error")]
    assert engine.block_manager.num_used == 0 and not engine.has_work()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_sliding_window_model_embeds_inputs_longer_than_its_window(tmp_path: Path, pooling: str) -> None:
    """Mistral with a window of 16 in every layer: an input's early blocks go back to the pool as its chunks
    advance, and its vector is still HF's."""
    path = build_tiny_checkpoint(tmp_path / "mistral", "mistral", seed=9, sliding_window=16)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = engine_for(path, embedding_pooling=pooling, max_num_batched_tokens=16, max_num_seqs=2)
    inputs = [list(range(10, 90)), [200, 100] * 30, [7, 8]]
    engine.add_request(embed("w", inputs))  # type: ignore[arg-type]
    done = []
    while engine.has_work():
        done += engine.step()
        engine.scheduler.check_invariants()
    assert engine.block_manager.window_released > 0
    (res,) = done
    assert res.embeddings is not None
    for ids, got in zip(inputs, res.embeddings, strict=True):
        assert (torch.tensor(got) - hf_vector(hf, ids, pooling)).abs().max().item() < TOL
