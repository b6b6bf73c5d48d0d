"""Image lines as users send them: `producer submit` of a JSONL file whose chat lines carry images (a data:
URL, and file:// paths beside the file), a real worker serving a tiny random Qwen2-VL, a real Redis. Each
row answers as Hugging Face's float32 generate does, token for token; `choices` over an image scores its
labels as HF's log-probabilities do (within 1e-4); a text line in the same batch answers as HF too; and
one photo asked several questions is stored once."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from tests.tiny_models import BYTE_OFFSET, EOS_ID
from tests.tiny_vision import IMAGE_PAD, build_tiny_qwen2_vl, hf_vl, hf_vl_generate, hf_vl_logprobs, png
from tests.worker.conftest import assert_consistent, results_count, submit, wait_until, write_jsonl
from tests.worker.test_faults import FAST

pytestmark = pytest.mark.slow

LABELS = ["cat", "dog", "bird"]


def hf_inputs(path: Path, messages: list[dict[str, Any]], images: list[bytes]) -> tuple[list[int], Any, Any]:
    """The Qwen2-VL processor's inputs: the template's ids with each placeholder repeated to its image's
    tokens, and the images' patches and grids from the checkpoint's PIL image processor."""
    from PIL import Image
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False).input_ids  # fmt: skip
    if not images:
        return ids, None, None
    proc = Qwen2VLImageProcessorPil.from_pretrained(path)
    out = proc(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt")
    grids, it = out["image_grid_thw"], iter(out["image_grid_thw"])
    expanded = [x for t in ids for x in ([IMAGE_PAD] * int(next(it).prod() // 4) if t == IMAGE_PAD else [t])]
    return expanded, out["pixel_values"], grids


def test_image_lines_answer_as_hf_generate(server, workers, tmp_path):
    model = build_tiny_qwen2_vl(tmp_path / "qwen2-vl", seed=5)
    photos = {"a.png": png(56, 56, 1), "b.png": png(84, 56, 2)}
    for name, data in photos.items():
        (tmp_path / name).write_bytes(data)
    inline = png(60, 90, 3)
    data_url = "data:image/png;base64," + base64.b64encode(inline).decode()

    def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": list(parts)}]

    def image(url: str) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": url}}

    def text(t: str) -> dict[str, Any]:
        return {"type": "text", "text": t}

    lines = [  # (messages as sent, the images' bytes in order, choices)
        (user(image("file://a.png"), text("What is this?")), [photos["a.png"]], None),
        (user(image("file://a.png"), text("Is it red?")), [photos["a.png"]], None),
        (user(image("file://a.png"), image("file://b.png"), text("Compare.")), [photos["a.png"], photos["b.png"]], None),
        (user(image(data_url), text("And this one?")), [inline], None),
        ([{"role": "user", "content": "No image here."}], [], None),
        (user(image("file://b.png"), text("Which animal?")), [photos["b.png"]], LABELS),
    ]  # fmt: skip
    rows = []
    for i, (messages, _, choices) in enumerate(lines):
        # logprobs: each token's bytes (the byte tokenizer's random text is no valid UTF-8 to compare)
        row: dict[str, Any] = {"id": f"r{i}", "messages": messages, "max_new_tokens": 8, "temperature": 0,
                               "logprobs": True}  # fmt: skip
        if choices:
            row.update(choices=choices, max_new_tokens=1, logprobs=False)
        rows.append(row)
    w = workers(server.url, str(model), *FAST, "--dtype", "float32").wait_ready()
    bid = submit(server.url, write_jsonl(tmp_path / "in.jsonl", rows))
    wait_until(lambda: results_count(server.url, bid) == len(rows), 180, "every result")
    results = assert_consistent(server.url, bid, len(rows))
    images = [k for k in redis.Redis.from_url(server.url).scan_iter("batchq:image:*")]
    assert len(images) == 3  # a.png asked three questions, b.png two: each stored once
    hf = hf_vl(model)
    for i, (messages, imgs, choices) in enumerate(lines):
        res = results[i]
        assert res["error"] is None, res
        as_engine = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                      [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]}
                     for m in messages]  # fmt: skip
        ids, pixels, grids = hf_inputs(model, as_engine, imgs)
        assert res["usage"]["prompt_tokens"] == len(ids), res
        if choices:
            for score, label in zip(res["label_scores"], choices, strict=True):
                lab = w_label_ids(model, label)
                lp = hf_vl_logprobs(hf, ids + lab, pixels, grids)
                want = sum(float(lp[len(ids) - 1 + k, t]) for k, t in enumerate([*lab, EOS_ID]))
                assert abs(score["logprob"] - want) < 1e-4, (label, score, want)
            continue
        want_ids = hf_vl_generate(hf, ids, pixels, grids, 8)
        got = [entry["bytes"] for entry in res["logprobs"]["content"]]
        assert got == [[t - BYTE_OFFSET] for t in want_ids if t != EOS_ID], (i, got, want_ids)
    assert w.proc.poll() is None
    _ = torch


def w_label_ids(model: Path, label: str) -> list[int]:
    """A label's tokens as the engine takes them: tokenised alone, no special tokens."""
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(model)(label, add_special_tokens=False).input_ids)
