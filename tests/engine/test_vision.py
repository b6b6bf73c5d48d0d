"""Images through the engine library on a tiny random Qwen2-VL (its vision tower, merger and decoder random,
norms and biases perturbed): requests of 1-3 images of different sizes and text-only requests in one batch
answer as Hugging Face's float32 generate does, token for token; `choices` over an image scores its labels
as HF's log-probabilities do (within 1e-4). The prefix cache reuses an image's KV for another question about
it, and never gives one image's KV to another image behind the same text. Bad images are refused alone.
A tiny LLaVA-1.5 (CLIP tower, projector, Llama decoder) and a tiny Qwen2.5-VL (its windowed tower) answer
as their HF generate too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tiny_models import EOS_ID
from tests.tiny_vision import IMAGE_PAD, build_tiny_qwen2_vl, hf_vl, hf_vl_generate, hf_vl_logprobs, png
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest
from worker.engine_config import EngineConfig

LABELS = ("cat", "dog", "bird")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Engine, Any]:
    path = build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl"), seed=3)
    engine = Engine.load(EngineConfig(model=str(path), device="cpu", dtype="float32", kv_cache_gb=0.02,
                                      block_size=4))  # fmt: skip
    return path, engine, hf_vl(path)


def chat(n_images: int, question: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(n_images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def reference_inputs(
    engine: Engine, messages: list[dict[str, Any]], images: list[bytes]
) -> tuple[list[int], Any, Any]:
    """What HF's Qwen2-VL processor gives: the template's ids with each image's placeholder repeated to its
    tokens, the images' patches and grids (its PIL image processor, from the checkpoint's config)."""
    import io

    from PIL import Image

    tok = engine.tokenizer
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False).input_ids  # fmt: skip
    if not images:
        return ids, None, None
    assert engine.images is not None
    proc = engine.images.tower.processor
    out = proc(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt")
    grids = out["image_grid_thw"]
    expanded, it = [], iter(grids)
    for t in ids:
        expanded += [IMAGE_PAD] * int(next(it).prod() // 4) if t == IMAGE_PAD else [t]
    return expanded, out["pixel_values"], grids


def test_image_and_text_rows_answer_as_hf_generate(tiny: tuple[Path, Engine, Any]) -> None:
    _, engine, hf = tiny
    assert engine.takes_images
    cases = [
        (chat(1, "What is in this picture?"), [png(56, 56, 1)]),
        (chat(2, "Compare them."), [png(84, 56, 2), png(60, 90, 3)]),
        (chat(3, "Three?"), [png(30, 30, 4), png(112, 56, 5), png(56, 84, 6)]),
        ([{"role": "user", "content": "Only text here, no image at all."}], []),
        (chat(1, "Describe it."), [png(56, 56, 1)]),  # the first image again, another question
    ]
    greedy = GenerationParams(max_new_tokens=8, temperature=0.0)
    reqs = [
        EngineRequest(f"r{i}", greedy, messages=m, images=imgs or None) for i, (m, imgs) in enumerate(cases)
    ]
    results = engine.generate(reqs)
    for (messages, images), res in zip(cases, results, strict=True):
        assert res.error is None, res.error
        ids, pixels, grids = reference_inputs(engine, messages, images)
        assert res.prompt_tokens == len(ids)
        assert res.token_ids == hf_vl_generate(hf, ids, pixels, grids, 8), res.request_id
    # the same image asked another question: its blocks came from the prefix cache
    assert results[4].cached_tokens > 0


def test_choices_over_an_image_score_as_hf(tiny: tuple[Path, Engine, Any]) -> None:
    _, engine, hf = tiny
    messages, images = chat(1, "Which animal?"), [png(70, 56, 9)]
    label = GenerationParams(max_new_tokens=1, temperature=0.0, choices=LABELS)
    (res,) = engine.generate([EngineRequest("l", label, messages=messages, images=images)])
    assert res.label_scores is not None
    ids, pixels, grids = reference_inputs(engine, messages, images)
    for score, lab in zip(res.label_scores, engine.prompts.label_ids(LABELS), strict=True):
        lp = hf_vl_logprobs(hf, ids + lab, pixels, grids)
        want = sum(float(lp[len(ids) - 1 + i, t]) for i, t in enumerate([*lab, EOS_ID]))
        assert abs(score.logprob - want) < 1e-4, (score.label, score.logprob, want)


def test_another_image_behind_the_same_text_gets_no_cached_kv(tiny: tuple[Path, Engine, Any]) -> None:
    _, engine, hf = tiny
    greedy = GenerationParams(max_new_tokens=4, temperature=0.0)
    messages = chat(1, "Same words each time, a different picture.")
    first = engine.generate([EngineRequest("a", greedy, messages=messages, images=[png(56, 56, 20)])])[0]
    second = engine.generate([EngineRequest("b", greedy, messages=messages, images=[png(56, 56, 21)])])[0]
    # the text before the image may be shared; no block holding an image token is
    assert second.cached_tokens <= 4 * (
        (len(reference_inputs(engine, messages, [png(56, 56, 21)])[0]) - 1) // 4
    )
    ids, pixels, grids = reference_inputs(engine, messages, [png(56, 56, 21)])
    first_image = ids.index(IMAGE_PAD)
    assert second.cached_tokens <= first_image
    assert second.token_ids == hf_vl_generate(hf, ids, pixels, grids, 4)
    assert first.error is None


def test_bad_images_are_refused_alone(tiny: tuple[Path, Engine, Any]) -> None:
    _, engine, _ = tiny
    greedy = GenerationParams(max_new_tokens=2, temperature=0.0)
    out = engine.generate([
        EngineRequest("bad", greedy, messages=chat(1, "?"), images=[b"not an image"]),
        EngineRequest("mismatch", greedy, messages=chat(2, "?"), images=[png(56, 56, 1)]),
        EngineRequest("good", greedy, messages=chat(1, "?"), images=[png(56, 56, 1)]),
        EngineRequest("thin", greedy, messages=chat(1, "?"), images=[png(3, 700, 2)]),  # the processor refuses it
    ])  # fmt: skip
    assert out[0].error is not None and "image 0: not a decodable image" in out[0].error.message
    assert out[1].error is not None and "2 image placeholders for 1 images" in out[1].error.message
    assert out[2].error is None
    assert (
        out[3].error is not None and "image 0: the model's image processor refuses it" in out[3].error.message
    )


def test_a_refused_duplicate_never_lends_its_images_to_the_request_it_repeats(
    tiny: tuple[Path, Engine, Any],
) -> None:
    _, engine, hf = tiny
    greedy = GenerationParams(max_new_tokens=6, temperature=0.0)
    messages = chat(1, "Which one?")
    engine.add_request(EngineRequest("dup", greedy, messages=messages, images=[png(56, 56, 30)]))
    engine.add_request(EngineRequest("dup", greedy, messages=messages, images=[png(56, 56, 31)]))
    out = []
    while engine.has_work():
        out += engine.step()
    first = next(r for r in out if r.error is None)
    refused = next(r for r in out if r.error is not None)
    assert "already running" in refused.error.message  # type: ignore[union-attr]
    ids, pixels, grids = reference_inputs(engine, messages, [png(56, 56, 30)])
    assert first.token_ids == hf_vl_generate(hf, ids, pixels, grids, 6)
    assert not engine.images._prep and not engine.images._ready  # type: ignore[union-attr]  # nothing kept
    engine.step()  # (an intake: what the last one refused is dropped)
    assert not engine.images._ready  # type: ignore[union-attr]


def test_a_text_model_refuses_images(tmp_path: Path) -> None:
    from tests.tiny_models import build_tiny_checkpoint

    e = Engine.load(EngineConfig(model=str(build_tiny_checkpoint(tmp_path / "t", "llama")), device="cpu",
                                 dtype="float32", kv_cache_gb=0.01))  # fmt: skip
    assert not e.takes_images
    (res,) = e.generate([EngineRequest("x", GenerationParams(max_new_tokens=2), messages=chat(1, "?"),
                                       images=[png(56, 56, 1)])])  # fmt: skip
    assert (
        res.error is not None and res.error.type == "unsupported" and "takes no images" in res.error.message
    )
    _ = torch  # (torch imported for the fixtures' tensors)


Cases = list[tuple[list[dict[str, Any]], list[bytes]]]


def family_answers(path: Path, cases: Cases) -> tuple[Engine, list[list[int]]]:
    """A fresh engine of the checkpoint at `path`, and its greedy tokens for `cases` run in one batch."""
    e = Engine.load(EngineConfig(model=str(path), device="cpu", dtype="float32", kv_cache_gb=0.02,
                                 block_size=4))  # fmt: skip
    greedy = GenerationParams(max_new_tokens=8, temperature=0.0)
    out = e.generate([EngineRequest(f"r{i}", greedy, messages=m, images=imgs or None)
                      for i, (m, imgs) in enumerate(cases)])  # fmt: skip
    assert all(r.error is None for r in out), [r.error for r in out]
    return e, [r.token_ids for r in out]


def test_llava_image_and_text_rows_answer_as_hf_generate(tmp_path: Path) -> None:
    import io

    from PIL import Image
    from transformers import LlavaForConditionalGeneration

    from tests.tiny_vision import build_tiny_llava

    path = build_tiny_llava(tmp_path / "llava", seed=2)
    cases = [(chat(2, "What differs?"), [png(56, 40, 1), png(30, 60, 2)]), (chat(1, "And this?"), [png(80, 80, 3)]),
             ([{"role": "user", "content": "Text alone."}], [])]  # fmt: skip
    e, answers = family_answers(path, cases)
    hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    tok = e.tokenizer
    for (messages, images), got in zip(cases, answers, strict=True):
        ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False).input_ids  # fmt: skip
        expanded = [x for t in ids for x in ([IMAGE_PAD] * 4 if t == IMAGE_PAD else [t])]  # 28 px / 14: 4
        x = torch.tensor([expanded])
        kwargs: dict[str, Any] = {}
        if images:
            assert e.images is not None
            rgb = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
            kwargs["pixel_values"] = e.images.tower.processor(images=rgb, return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            want = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False,
                               **kwargs)[0, len(expanded) :].tolist()  # fmt: skip
        assert got == want


def test_qwen2_5_vl_answers_as_hf_generate(tmp_path: Path) -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tests.tiny_vision import build_tiny_qwen2_5_vl

    path = build_tiny_qwen2_5_vl(tmp_path / "qwen2.5-vl", seed=2)
    cases = [(chat(2, "Both?"), [png(112, 84, 1), png(56, 56, 2)]), (chat(1, "This?"), [png(70, 98, 3)]),
             ([{"role": "user", "content": "Text alone."}], [])]  # fmt: skip
    e, answers = family_answers(path, cases)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    for (messages, images), got in zip(cases, answers, strict=True):
        ids, pixels, grids = reference_inputs(e, messages, images)
        assert got == hf_vl_generate(hf, ids, pixels, grids, 8)


def test_samples_and_a_json_schema_over_an_image(tiny: tuple[Path, Engine, Any]) -> None:
    import json

    from worker.engine.params import Constraint

    _, engine, hf = tiny
    messages, images = chat(1, "Two answers, then JSON."), [png(56, 84, 11)]
    two = GenerationParams(max_new_tokens=6, temperature=0.0, n=2)
    schema = {"type": "object", "properties": {"label": {"enum": ["cat", "dog"]}}, "required": ["label"],
              "additionalProperties": False}  # fmt: skip
    constrained = GenerationParams(max_new_tokens=40, temperature=0.0,
                                   constraint=Constraint("json_schema", json.dumps(schema)))  # fmt: skip
    out = engine.generate([EngineRequest("two", two, messages=messages, images=images),
                           EngineRequest("json", constrained, messages=messages, images=images)])  # fmt: skip
    ids, pixels, grids = reference_inputs(engine, messages, images)
    want = hf_vl_generate(hf, ids, pixels, grids, 6)
    assert out[0].samples is not None and [s.token_ids for s in out[0].samples] == [want, want]
    assert json.loads(out[1].text)["label"] in ("cat", "dog")


def test_the_fingerprint_follows_the_vision_side(tiny: tuple[Path, Engine, Any], tmp_path: Path) -> None:
    """Two checkpoints with one decoder but another tower, or another image processor, answer image
    requests differently: their engines' fingerprints (which key the result cache) differ."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    path, engine, _ = tiny
    tower = shutil.copytree(path, tmp_path / "other-tower")
    weights = load_file(str(tower / "model.safetensors"))
    name = next(k for k in weights if k.startswith("visual.") and k.endswith("fc1.weight"))
    weights[name] = weights[name] + 0.01
    save_file(weights, str(tower / "model.safetensors"), metadata={"format": "pt"})
    processor = shutil.copytree(path, tmp_path / "other-processor")
    settings = json.loads((processor / "preprocessor_config.json").read_text())
    (processor / "preprocessor_config.json").write_text(json.dumps({**settings, "max_pixels": 28 * 28 * 8}))
    prints = {engine.fingerprint}
    for folder in (tower, processor):
        prints.add(Engine.load(EngineConfig(model=str(folder), device="cpu", dtype="float32", kv_cache_gb=0.02,
                                            block_size=4)).fingerprint)  # fmt: skip
    assert len(prints) == 3
