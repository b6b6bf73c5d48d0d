"""gpt-oss's harmony channels in the engine, against HF float32 greedy: a tiny random Qwen3 with a tokenizer
holding harmony's tokens (so `auto` picks the harmony parser), its template opening the analysis channel. The
budget forces the close through the final channel's header, several tokens fed as generated ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.test_reasoning_markers import HARMONY_SPECIALS, harmony_tokenizer
from tests.tiny_models import EOS_ID, VOCAB_SIZE, build_tiny_checkpoint, hf_greedy
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest
from worker.engine_config import EngineConfig

TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|channel|>analysis<|message|>{% endif %}"
)
ASK = [{"role": "user", "content": "Is it good?"}]
CLOSE = "<|end|><|start|>assistant<|channel|>final<|message|>"


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    path: Path = tmp_path_factory.mktemp("harmony")
    build_tiny_checkpoint(path, "qwen3", seed=4, vocab_size=VOCAB_SIZE + len(HARMONY_SPECIALS))
    tok = harmony_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine.load(EngineConfig(model=str(path), dtype="float32", kv_cache_gb=0.02, block_size=8))
    return engine, hf, tok


def text(tok, ids: list[int]) -> str:  # type: ignore[no-untyped-def]
    return str(tok.decode([t for t in ids if t != EOS_ID], skip_special_tokens=True)).rstrip("\ufffd")


def test_the_budget_closes_analysis_through_the_final_header(harmony) -> None:  # type: ignore[no-untyped-def]
    engine, hf, tok = harmony
    assert engine.reasoning is not None and engine.reasoning.kind == "harmony"
    prompt = list(tok(tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False).input_ids)  # fmt: skip
    close = list(tok(CLOSE, add_special_tokens=False).input_ids)
    budget = 3
    p = GenerationParams(max_new_tokens=30, temperature=0.0, max_reasoning_tokens=budget)
    free = GenerationParams(max_new_tokens=12, temperature=0.0)
    res, thinking = engine.generate(
        [EngineRequest("h", p, messages=ASK), EngineRequest("f", free, messages=ASK)]
    )
    ref = hf_greedy(hf, prompt, 30, forced={budget + i: t for i, t in enumerate(close)})
    assert res.token_ids == ref
    assert res.reasoning_content == text(tok, ref[:budget])
    assert res.text == text(tok, ref[budget + len(close) :])
    assert res.reasoning_tokens == budget + len(close)
    # without a budget the model thinks on (it never closes the channel): all of it is reasoning
    free_ref = hf_greedy(hf, prompt, 12)
    assert engine.reasoning.end not in free_ref
    assert thinking.token_ids == free_ref and thinking.text == "" and thinking.finish_reason == "length"
    assert thinking.reasoning_content == text(tok, free_ref)
