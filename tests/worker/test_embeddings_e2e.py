"""Embeddings end to end: one file mixing /v1/embeddings lines and chat lines, `producer submit` -> a real
worker process on a tiny random Qwen3 -> `producer results` (batchq JSONL and OpenAI's format), the vectors
checked against Hugging Face's pooled hidden states."""

from __future__ import annotations

import base64
import struct
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch

from tests.tiny_models import build_tiny_checkpoint
from tests.worker.conftest import ROOT, assert_consistent, results_count, submit, wait_until, write_jsonl

pytestmark = pytest.mark.slow

TOL = 1e-5


def results(url: str, bid: str, *args: str) -> list[dict[str, object]]:
    out = subprocess.run(
        [sys.executable, "-m", "producer.cli", "results", bid, "--redis-url", url, *args],
        capture_output=True, cwd=ROOT, check=True,
    )  # fmt: skip
    return [orjson.loads(x) for x in out.stdout.splitlines()]


@torch.no_grad()
def hf_last_token(hf, tok, text: str, dims: int | None = None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    ids = tok(text).input_ids
    last = hf.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(last[:dims], dim=-1)


def test_a_file_mixing_embeddings_and_chat_runs_through_the_queue_worker(
    server, workers, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = build_tiny_checkpoint(tmp_path / "qwen3", "qwen3", seed=11)
    chat = {"role": "user", "content": "label this"}
    lines = [
        {"id": "chat", "messages": [chat], "max_new_tokens": 6, "temperature": 0},
        {"id": "one", "input": "the first text", "metadata": {"row": 1}},
        {"custom_id": "oa", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": str(model), "input": ["alpha", "beta", "gamma"], "dimensions": 16,
                  "encoding_format": "base64"}},
        {"custom_id": "oa-chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [chat], "max_tokens": 4, "temperature": 0}},
        {"id": "too-wide", "input": "x", "dimensions": 65},
    ]  # fmt: skip
    w = workers(server.url, str(model), "--dtype", "float32", "--max-num-seqs", "4", name="emb")
    w.wait_ready()
    # the worker has published its embedding width: submit refuses the too-wide line (stored as failed)
    bid = submit(server.url, write_jsonl(tmp_path / "mixed.jsonl", lines), "--skip-invalid")
    wait_until(lambda: results_count(server.url, bid) == len(lines), 120, "every result")
    assert_consistent(server.url, bid, len(lines))

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model)
    got = {r["id"]: r for r in results(server.url, bid)}
    assert got["chat"]["finish_reason"] in ("eos", "length") and got["chat"]["text"] is not None
    one = got["one"]
    assert one["error"] is None and one["metadata"] == {"row": 1}
    (vec,) = one["embeddings"]
    assert (torch.tensor(vec) - hf_last_token(hf, tok, "the first text")).abs().max().item() < TOL
    assert one["usage"] == {"prompt_tokens": len(tok("the first text").input_ids), "completion_tokens": 0,
                            "total_tokens": len(tok("the first text").input_ids),
                            "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    wide = got["too-wide"]
    assert wide["finish_reason"] == "error" and "65 dimensions asked" in wide["error"]["message"]
    assert "embeds in 64" in wide["error"]["message"]

    openai = {x["custom_id"]: x for x in results(server.url, bid, "--format", "openai")}
    body = openai["oa"]["response"]["body"]
    assert body["object"] == "list" and body["model"] == str(model)
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for d, text in zip(body["data"], ["alpha", "beta", "gamma"], strict=True):
        packed = base64.b64decode(d["embedding"])
        vector = torch.tensor(struct.unpack("<16f", packed))
        assert (vector - hf_last_token(hf, tok, text, dims=16)).abs().max().item() < TOL
    total = sum(len(tok(t).input_ids) for t in ("alpha", "beta", "gamma"))
    assert body["usage"] == {"prompt_tokens": total, "total_tokens": total}
    assert openai["oa-chat"]["response"]["body"]["object"] == "chat.completion"
    assert openai["one"]["response"]["body"]["data"][0]["embedding"] == vec
    assert openai["too-wide"]["response"]["status_code"] == 400
