"""LoRA adapters through the engine library: one batch mixes base rows with three adapters of different
ranks (one rsLoRA, one with per-module alphas), and every row answers as HF + PEFT's unmerged model of its
adapter does: greedy tokens equal, logprobs and `choices` label scores within 1e-5. Slots: more adapters
than slots run in turn, the least recently used leaving; the prefix cache never shares KV across adapters.
Refusals name the adapter and the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.lora_adapters import build_adapter, peft_reference, targets
from tests.tiny_models import EOS_ID, build_tiny_checkpoint, hf_greedy
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest, EngineResult
from worker.engine_config import EngineConfig
from worker.models.errors import ModelLoadError

TOL = 1e-5
# A label's log-probability sums a term per token; with peaky random logits it reaches -50, where float32's
# rounding alone is ~1e-6 relative: the check allows 1e-5 plus that (its share, `prob`, is checked to 1e-5)
REL = 2e-6
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 43)), [200, 100] * 12 + [7]]
LABELS = ("positive", "negative", "pos")


def adapters(base: Path, root: Path, arch: str) -> dict[str, Path]:
    return {
        "r2": build_adapter(base, root / "r2", 2, targets(arch, "qv"), seed=1),
        "r4": build_adapter(base, root / "r4", 4, targets(arch, "all"), seed=2, use_rslora=True, alpha=6.0),
        "r8": build_adapter(
            base, root / "r8", 8, targets(arch, "mlp"), seed=3, alpha_pattern={targets(arch, "mlp")[-1]: 3.0}
        ),
    }


def engine(base: Path, loras: dict[str, Path], **settings: object) -> Engine:
    cfg = EngineConfig(model=str(base), device="cpu", dtype="float32", kv_cache_gb=0.02, block_size=8,
                       lora={k: str(v) for k, v in loras.items()}, **settings)  # type: ignore[arg-type]  # fmt: skip
    return Engine.load(cfg)


@torch.no_grad()
def log_softmax(model: object, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # type: ignore[operator]


def check_row(ref: object, prompt: list[int], res: EngineResult, label_ids: list[list[int]]) -> None:
    if res.label_scores is not None:
        wants = []
        for score, label in zip(res.label_scores, label_ids, strict=True):
            lp = log_softmax(ref, prompt + label)
            want = sum(float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate([*label, EOS_ID]))
            assert abs(score.logprob - want) < TOL + REL * abs(want), (
                res.request_id,
                score.label,
                score.logprob,
                want,
            )
            wants.append(want)
        probs = torch.softmax(torch.tensor(wants, dtype=torch.float64), 0)
        for score, p in zip(res.label_scores, probs.tolist(), strict=True):
            assert abs(score.prob - p) < TOL, (res.request_id, score.label, score.prob, p)
        return
    assert res.token_ids == hf_greedy(ref, prompt, 6), res.request_id
    lp = log_softmax(ref, prompt + res.token_ids)
    assert res.logprobs is not None
    for i, entry in enumerate(res.logprobs):
        assert abs(entry.logprob - float(lp[len(prompt) - 1 + i, res.token_ids[i]])) < TOL, (
            res.request_id,
            i,
        )


# cpu_kernels auto: lora.c's grouped pass; torch: torch's ops
@pytest.mark.parametrize("arch,kernels", [("llama", "auto"), ("qwen2", "auto"), ("gemma2", "auto"), ("phi3", "auto"),
                                          ("llama", "torch")])  # fmt: skip
def test_a_mixed_batch_answers_as_peft_row_by_row(tmp_path: Path, arch: str, kernels: str) -> None:
    base = build_tiny_checkpoint(tmp_path / "base", arch, seed=4)
    loras = adapters(base, tmp_path, arch)
    e = engine(base, loras, cpu_kernels=kernels)
    greedy = GenerationParams(max_new_tokens=6, temperature=0.0, logprobs=True)
    label = GenerationParams(max_new_tokens=1, temperature=0.0, choices=LABELS)
    reqs, want = [], {}
    for i, prompt in enumerate(PROMPTS):
        for name in (None, *loras):
            for kind, params in (("g", greedy), ("l", label)):
                rid = f"{kind}{i}-{name}"
                reqs.append(EngineRequest(rid, params, prompt_token_ids=prompt, lora=name))
                want[rid] = (name, prompt)
    results = e.generate(reqs)
    assert all(r.finish_reason != "error" for r in results), [r.error for r in results if r.error]
    layer = e.model_runner.model.layers[0].self_attn.qkv_proj.lora
    assert layer.grouped.name == ("torch" if kernels == "torch" else "c")
    refs = {name: peft_reference(base, None if name is None else loras[name]) for name in (None, *loras)}
    label_ids = e.prompts.label_ids(LABELS)
    for res in results:
        name, prompt = want[res.request_id]
        check_row(refs[name], prompt, res, label_ids)
    # the adapters change the answers (a test of nothing otherwise)
    by_id = {r.request_id: r.token_ids for r in results}
    assert len({tuple(by_id[f"g1-{n}"]) for n in (None, *loras)}) > 2


def test_more_adapters_than_slots_run_in_turn_and_never_share_kv(tmp_path: Path) -> None:
    base = build_tiny_checkpoint(tmp_path / "base", "llama", seed=5)
    loras = adapters(base, tmp_path, "llama")
    e = engine(base, loras, max_loras=2)
    greedy = GenerationParams(max_new_tokens=6, temperature=0.0)
    prompt = list(range(10, 43))  # four full blocks: a prefix-cache hit across adapters would show
    reqs = [EngineRequest(f"{n}-{k}", greedy, prompt_token_ids=prompt, lora=n)
            for k in range(2) for n in (None, "r2", "r4", "r8")]  # fmt: skip
    results = {r.request_id: r for r in e.generate(reqs)}
    for name in (None, "r2", "r4", "r8"):
        ref = peft_reference(base, None if name is None else loras[name])
        want = hf_greedy(ref, prompt, 6)
        for k in range(2):
            assert results[f"{name}-{k}"].token_ids == want, (name, k)
    assert e.loras is not None and len(e.loras.resident()) == 2
    # each adapter's first run computed the whole prompt (the others' K/V of it is not its own); its second
    # found its own in the prefix cache
    for name in ("r2", "r4", "r8"):
        assert results[f"{name}-0"].cached_tokens == 0, name
        assert results[f"{name}-1"].cached_tokens > 0, name


def test_unknown_adapters_are_refused_per_request(tmp_path: Path) -> None:
    base = build_tiny_checkpoint(tmp_path / "base", "llama", seed=6)
    e = engine(base, {"r2": build_adapter(base, tmp_path / "r2", 2, ["q_proj"], seed=1)})
    params = GenerationParams(max_new_tokens=2, temperature=0.0)
    out = e.generate([EngineRequest("x", params, prompt_token_ids=[5, 6], lora="nope"),
                      EngineRequest("y", params, prompt_token_ids=[5, 6], lora="r2")])  # fmt: skip
    assert out[0].finish_reason == "error" and out[0].error is not None
    assert out[0].error.type == "model_not_found" and "'nope'" in out[0].error.message
    assert out[1].finish_reason != "error"


def refusal(tmp_path: Path, edit: dict[str, object] | None = None, **build: object) -> str:
    base = build_tiny_checkpoint(tmp_path / "base", "llama", seed=7)
    modules = build.pop("modules", ["q_proj"])
    path = build_adapter(base, tmp_path / "bad", int(build.pop("rank", 2)), modules, seed=1)  # type: ignore[arg-type]
    if edit:
        cfg = json.loads((path / "adapter_config.json").read_text())
        cfg.update(edit)
        (path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as err:
        engine(base, {"bad": path}, **build)
    return str(err.value)


def test_a_rank_above_max_lora_rank_is_refused(tmp_path: Path) -> None:
    msg = refusal(tmp_path, rank=8, max_lora_rank=4)
    assert "adapter 'bad'" in msg and "rank 8, above max_lora_rank 4" in msg


def test_an_adapter_for_another_base_is_refused(tmp_path: Path) -> None:
    msg = refusal(tmp_path, {"base_model_name_or_path": "meta-llama/Llama-3.1-8B"})
    assert "adapter 'bad' was trained for base model 'meta-llama/Llama-3.1-8B'" in msg


def test_an_adapter_of_other_shapes_is_refused(tmp_path: Path) -> None:
    other = build_tiny_checkpoint(tmp_path / "other", "llama", seed=7, hidden_size=32)
    path = build_adapter(other, tmp_path / "bad", 2, ["q_proj"], seed=1)
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = None  # its shapes alone tell
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    base = build_tiny_checkpoint(tmp_path / "base", "llama", seed=7)
    with pytest.raises(
        ModelLoadError,
        match=r"adapter .bad.: module .*q_proj.*takes 64 inputs to 64 outputs \(an adapter for another base",
    ):
        engine(base, {"bad": path})


def test_unsupported_settings_and_targets_are_refused_by_name(tmp_path: Path) -> None:
    assert "DoRA (use_dora) is not supported" in refusal(tmp_path / "a", {"use_dora": True})
    assert "embed_tokens is not supported" in refusal(tmp_path / "b", modules=["embed_tokens"])
    assert "peft_type 'IA3'" in refusal(tmp_path / "c", {"peft_type": "IA3"})
    assert "KaSA (kasa_config) is not supported" in refusal(tmp_path / "d", {"kasa_config": {"any": 1}})
    assert "MiCA (init_lora_weights 'mica')" in refusal(tmp_path / "e", {"init_lora_weights": "mica"})


def test_a_rows_numbers_do_not_depend_on_its_neighbours(tmp_path: Path) -> None:
    base = build_tiny_checkpoint(tmp_path / "base", "qwen2", seed=8)
    loras = adapters(base, tmp_path, "qwen2")
    e = engine(base, loras)  # batch_invariant, the default
    assert e.batch_invariant
    greedy = GenerationParams(max_new_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3)
    label = GenerationParams(max_new_tokens=1, temperature=0.0, choices=LABELS)

    def mine() -> list[EngineRequest]:
        return [EngineRequest("me", greedy, prompt_token_ids=PROMPTS[1], lora="r4"),
                EngineRequest("my-label", label, prompt_token_ids=PROMPTS[2], lora="r4")]  # fmt: skip

    alone = {r.request_id: r for r in e.generate(mine())}
    crowd = [EngineRequest(f"n{i}-{n}", greedy, prompt_token_ids=p, lora=n)
             for i, p in enumerate(PROMPTS) for n in (None, "r2", "r4", "r8")]  # fmt: skip
    among = {r.request_id: r for r in e.generate([*crowd[:5], *mine(), *crowd[5:]])}
    for rid in ("me", "my-label"):
        a, b = alone[rid], among[rid]
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # bit for bit, top alternatives included
        assert a.label_scores == b.label_scores


def test_a_mixture_of_experts_model_takes_adapters_on_attention(tmp_path: Path) -> None:
    base = build_tiny_checkpoint(
        tmp_path / "base", "mixtral", seed=9, num_local_experts=4, num_experts_per_tok=2
    )
    path = build_adapter(base, tmp_path / "attn", 4, ["q_proj", "k_proj", "v_proj", "o_proj"], seed=2)
    e = engine(base, {"attn": path})
    greedy = GenerationParams(max_new_tokens=6, temperature=0.0)
    out = e.generate([EngineRequest(f"{n}-{i}", greedy, prompt_token_ids=p, lora=n)
                      for i, p in enumerate(PROMPTS) for n in (None, "attn")])  # fmt: skip
    refs = {None: peft_reference(base, None), "attn": peft_reference(base, path)}
    for res in out:
        name = None if res.request_id.startswith("None") else "attn"
        prompt = PROMPTS[int(res.request_id.rsplit("-", 1)[1])]
        assert res.token_ids == hf_greedy(refs[name], prompt, 6), res.request_id
