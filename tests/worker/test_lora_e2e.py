"""`worker --lora NAME=PATH` as users run it: a real worker process serving three PEFT adapters built by
`peft` over a tiny Llama, a real Redis, and a batch submitted with `producer submit` whose lines name the
base model or an adapter in `model` (OpenAI's lines) or `lora` (batchq's). Every row answers as HF + PEFT's
unmerged model of its adapter does, and names the adapter that ran; an unknown adapter gets a per-line 404
model_not_found; a bad adapter is refused at start-up with one line naming it; `--lora-dir` adapters are
found by name on first use, and the heartbeat lists those resident."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
import torch

from producer.wire import keys
from tests.lora_adapters import build_adapter, peft_reference
from tests.worker.conftest import assert_consistent, results_count, submit, wait_until, write_jsonl
from tests.worker.test_faults import FAST

pytestmark = pytest.mark.slow

PROMPTS = ["The weather today is", "Once upon a time", "Q: what is two plus two?\nA:"]
ADAPTERS = {"qv": (2, ["q_proj", "v_proj"], {}), "all": (4, None, {"use_rslora": True}), "mlp": (8, ["gate_proj", "up_proj", "down_proj"], {})}  # fmt: skip
F32 = [*FAST, "--dtype", "float32"]  # PEFT's reference computes in float32
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: build_adapter(tiny_model_dir, root / name, rank, modules or ALL, seed=i + 1, **settings)
            for i, (name, (rank, modules, settings)) in enumerate(ADAPTERS.items())}  # fmt: skip


@torch.no_grad()
def peft_text(model: Any, tok: Any, prompt: str, n: int) -> str:
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
    )
    new = out[0, ids.shape[1] :].tolist()
    return str(tok.decode([t for t in new if t != tok.eos_token_id], skip_special_tokens=True))


def lines(base: str) -> tuple[list[dict[str, Any]], list[str | None]]:
    """OpenAI lines naming each model in body.model, a batchq line per adapter naming it in `lora`, and one
    for an adapter no worker serves. -> the lines, and the adapter each runs (None: the base model)."""
    out: list[dict[str, Any]] = []
    runs: list[str | None] = []
    for i, prompt in enumerate(PROMPTS):
        for name in (None, *ADAPTERS):
            body = {"model": name or base, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            out.append(
                {"custom_id": f"o{i}-{name}", "method": "POST", "url": "/v1/completions", "body": body}
            )
            runs.append(name)
    for name in ADAPTERS:
        out.append({"custom_id": f"n-{name}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": name, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}})  # fmt: skip
        runs.append(name)
    out.append({"custom_id": "unknown", "method": "POST", "url": "/v1/completions",
                "body": {"model": "no-such-adapter", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}})  # fmt: skip
    runs.append("no-such-adapter")
    return out, runs


def test_a_mixed_batch_answers_as_peft_row_by_row(server, workers, tiny_model_dir, adapters, tmp_path):
    from transformers import AutoTokenizer

    flags = [x for name, path in adapters.items() for x in ("--lora", f"{name}={path}")]
    w = workers(server.url, str(tiny_model_dir), *F32, *flags, "--max-loras", "2").wait_ready()
    batch, runs = lines(str(tiny_model_dir))
    bid = submit(server.url, write_jsonl(tmp_path / "in.jsonl", batch))
    wait_until(lambda: results_count(server.url, bid) == len(batch), 180, "every result")
    results = assert_consistent(server.url, bid, len(batch))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    refs = {
        name: peft_reference(tiny_model_dir, None if name is None else adapters[name])
        for name in (None, *ADAPTERS)
    }
    texts = {}
    for i, (line, name) in enumerate(zip(batch, runs, strict=True)):
        res = results[i]
        if name == "no-such-adapter":
            assert res["finish_reason"] == "error" and res["error"]["type"] == "model_not_found", res
            assert "'no-such-adapter'" in res["error"]["message"]
            continue
        assert res["error"] is None, res
        assert res["model"] == (name or str(tiny_model_dir)), res
        want = peft_text(refs[name], tok, line["body"]["prompt"], 8)
        assert res["text"] == want, (line["custom_id"], res["text"], want)
        texts[line["custom_id"]] = res["text"]
    assert len({texts[f"o0-{n}"] for n in (None, *ADAPTERS)}) > 2  # the adapters change the answers
    beat = orjson.loads(redis.Redis.from_url(server.url).get(keys.worker_heartbeat(w.id)))
    assert 1 <= len(beat["loras"]) <= 2 and set(beat["loras"]) <= set(ADAPTERS)


def test_adapters_in_a_folder_are_found_by_name_and_a_bad_one_is_refused_at_start(
    server, workers, tiny_model_dir, adapters, tmp_path
):
    folder = tmp_path / "lora-dir"
    folder.mkdir()
    (folder / "qv").symlink_to(adapters["qv"])
    w = workers(server.url, str(tiny_model_dir), *F32, "--lora-dir", str(folder), name="dir").wait_ready()
    batch = [{"id": "x", "prompt": PROMPTS[1], "max_new_tokens": 6, "temperature": 0, "lora": "qv"}]
    bid = submit(server.url, write_jsonl(tmp_path / "in.jsonl", batch))
    wait_until(lambda: results_count(server.url, bid) == 1, 120, "the result")
    (res,) = assert_consistent(server.url, bid, 1).values()
    from transformers import AutoTokenizer

    want = peft_text(
        peft_reference(tiny_model_dir, adapters["qv"]),
        AutoTokenizer.from_pretrained(tiny_model_dir),
        PROMPTS[1],
        6,
    )
    assert res["model"] == "qv" and res["text"] == want, res
    w.stop()
    bad = workers(server.url, str(tiny_model_dir), *F32, "--lora", f"big={adapters['mlp']}", "--max-lora-rank", "4",
                  name="bad")  # fmt: skip
    assert bad.wait(120) == 2, bad.log()
    assert "adapter 'big'" in bad.full_log() and "above max_lora_rank 4" in bad.full_log()
