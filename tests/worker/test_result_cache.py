"""The result cache: what its key depends on, and nightly reruns answered from it by a real worker."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from tests.tiny_models import build_tiny_checkpoint
from tests.worker.conftest import ROOT, assert_consistent, results_count, submit, wait_until, write_jsonl
from worker.engine.fingerprint import NUMERICS_VERSION, engine_fingerprint, weights_digest
from worker.engine.params import GenerationParams
from worker.models.loader import load_model
from worker.result_cache import output_key

FP = "f" * 32
PROMPT = [5, 6, 7, 8]
SEEDED = GenerationParams(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=3)
GREEDY = GenerationParams(max_new_tokens=8, temperature=0.0, seed=3)

# Every parameter that can change the tokens or the text, with another value for it.
OUTPUT_FIELDS = {
    "max_new_tokens": 9, "temperature": 0.8, "top_p": 0.5, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.3,
    "seed": 4, "stop": ("x",), "stop_token_ids": (9,), "include_stop_str_in_output": True, "ignore_eos": True,
    "truncate_prompt": "left",
}  # fmt: skip


def test_every_parameter_field_is_classified() -> None:
    fields = {f.name for f in dataclasses.fields(GenerationParams)}
    assert fields == set(OUTPUT_FIELDS) | {"timeout_s"}


@pytest.mark.parametrize("field", sorted(OUTPUT_FIELDS))
def test_the_key_misses_when_an_output_changing_parameter_differs(field: str) -> None:
    other = dataclasses.replace(SEEDED, **{field: OUTPUT_FIELDS[field]})
    assert output_key(FP, PROMPT, other, seeded=True) != output_key(FP, PROMPT, SEEDED, seeded=True)


def test_the_key_misses_when_the_prompt_or_the_engine_differs() -> None:
    key = output_key(FP, PROMPT, GREEDY, seeded=False)
    assert key is not None and key.startswith("batchq:result-cache:")
    assert output_key(FP, [*PROMPT, 9], GREEDY, seeded=False) != key
    assert output_key("e" * 32, PROMPT, GREEDY, seeded=False) != key


def test_what_cannot_change_the_output_does_not_change_the_key() -> None:
    key = output_key(FP, PROMPT, GREEDY, seeded=False)
    assert output_key(FP, PROMPT, dataclasses.replace(GREEDY, timeout_s=5.0), seeded=False) == key
    for field in ("seed", "top_p", "top_k", "min_p"):  # greedy decoding takes the argmax before these
        assert (
            output_key(FP, PROMPT, dataclasses.replace(GREEDY, **{field: OUTPUT_FIELDS[field]}), False) == key
        )


def test_unseeded_sampling_is_never_cached() -> None:
    assert output_key(FP, PROMPT, SEEDED, seeded=False) is None
    assert output_key(FP, PROMPT, SEEDED, seeded=True) is not None


def test_the_fingerprint_follows_the_weights_the_dtype_and_the_numerics(tmp_path: Path) -> None:
    a = build_tiny_checkpoint(tmp_path / "a", "llama", seed=0)
    b = build_tiny_checkpoint(tmp_path / "b", "llama", seed=1)
    cpu = torch.device("cpu")
    wa = weights_digest(load_model(str(a), torch.float32, cpu).model)
    assert weights_digest(load_model(str(a), torch.float32, cpu).model) == wa  # stable across loads
    assert weights_digest(load_model(str(b), torch.float32, cpu).model) != wa  # other weights
    assert weights_digest(load_model(str(a), torch.bfloat16, cpu).model) != wa  # other dtype
    assert engine_fingerprint(wa, device="cpu") != engine_fingerprint(wa, device="cuda")
    assert NUMERICS_VERSION >= 1


# ---- a nightly rerun, end to end ---------------------------------------------------------------------


def results_of(url: str, batch_id: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "producer.cli", "results", batch_id, "--redis-url", url],
        capture_output=True, cwd=ROOT, check=True,
    )  # fmt: skip
    return [orjson.loads(x) for x in out.stdout.splitlines()]


def status_of(url: str, batch_id: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "producer.cli", "status", batch_id, "--json", "--redis-url", url],
        capture_output=True, cwd=ROOT, check=True,
    )  # fmt: skip
    return dict(orjson.loads(out.stdout))


@pytest.mark.slow
def test_a_rerun_batch_is_answered_from_the_cache_with_the_original_answers(
    server, workers, tiny_model_dir, tmp_path
) -> None:
    lines = [
        {"id": f"g{i}", "prompt": f"Label item {i}:", "max_new_tokens": 6, "temperature": 0} for i in range(6)
    ]
    lines += [{"id": f"s{i}", "prompt": f"Write {i}", "max_new_tokens": 6, "temperature": 0.9, "seed": i}
              for i in range(3)]  # fmt: skip
    lines += [{"id": "u0", "prompt": "Write freely", "max_new_tokens": 6, "temperature": 0.9}]  # unseeded
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    workers(server.url, str(tiny_model_dir), "--repetition-repeats", "0", name="a").wait_ready()

    first = submit(server.url, path)
    wait_until(lambda: results_count(server.url, first) == len(lines), 120, "the first run")
    again = submit(server.url, path)
    wait_until(lambda: results_count(server.url, again) == len(lines), 120, "the rerun")
    fresh = submit(server.url, path, "--no-result-cache")
    wait_until(lambda: results_count(server.url, fresh) == len(lines), 120, "the forced recomputation")
    for bid in (first, again, fresh):
        assert_consistent(server.url, bid, len(lines))

    one, two, three = (
        results_of(server.url, first),
        results_of(server.url, again),
        results_of(server.url, fresh),
    )
    assert not any(r["cached"] for r in one)
    assert [r["cached"] for r in two] == [True] * 9 + [False]  # unseeded sampling never hits
    assert not any(r["cached"] for r in three)
    for a, b, c in zip(one[:9], two[:9], three[:9], strict=True):
        assert a["text"] == b["text"] == c["text"], a["id"]  # a hit is what the engine computes afresh
        assert a["usage"] == b["usage"] and a["finish_reason"] == b["finish_reason"]
        assert b["timing"]["ttft_s"] is None
    assert status_of(server.url, again)["from_result_cache"] == 9
    assert status_of(server.url, fresh)["from_result_cache"] == 0
