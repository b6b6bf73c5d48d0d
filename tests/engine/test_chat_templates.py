"""Chat templates, special tokens and EOS sets of the families, as Hugging Face handles them.

Each family gets a tokenizer with its own special tokens and its published chat template (Gemma's
`<start_of_turn>` / `<end_of_turn>` turns with a `<bos>` in the template and no system role, on Gemma 1
through transformers and Gemma 2 natively; Phi-3's
`<|user|>` / `<|assistant|>` / `<|end|>`), and a generation config whose EOS set holds the end-of-turn
token beside the model's EOS, as the instruct checkpoints ship them. The tiny model's LM-head row of the
end-of-turn token is scaled so that some answers end on it and others run to max_new_tokens: the
engine's greedy texts and finish reasons, chat messages in, must equal HF `generate` on
`apply_chat_template`'s ids with the generation config's EOS set, decoded without special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from tests.tiny_models import BYTE_OFFSET, byte_tokenizer, hf_reference, perturb, tiny_config
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest
from worker.engine_config import EngineConfig

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)


@dataclass(frozen=True)
class ChatFamily:
    arch: str
    specials: list[str]  # added after the byte tokenizer's ids, in this order
    bos: str
    eos: str  # the config's eos_token
    end_of_turn: str  # in the generation config's EOS set too
    template: str
    overrides: dict[str, Any]
    end_of_turn_boost: float  # chosen so that this seed's answers end both ways
    system_refused: bool = False


FAMILIES = {
    "gemma": ChatFamily(
        "gemma",
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        bos="<bos>",
        eos="<eos>",
        end_of_turn="<end_of_turn>",
        template=GEMMA_TEMPLATE,
        overrides={"head_dim": 16, "hidden_activation": "gelu_pytorch_tanh"},
        end_of_turn_boost=2.0,
        system_refused=True,
    ),
    # Gemma 2 on the native decoder, with Gemma's template and <end_of_turn> in its EOS set
    "gemma2": ChatFamily(
        "gemma2",
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        bos="<bos>",
        eos="<eos>",
        end_of_turn="<end_of_turn>",
        template=GEMMA_TEMPLATE,
        overrides={"head_dim": 16, "sliding_window": 16},
        end_of_turn_boost=2.0,
        system_refused=True,
    ),
    "phi3": ChatFamily(
        "phi3",
        ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        bos="<s>",
        eos="<|endoftext|>",
        end_of_turn="<|end|>",
        template=PHI3_TEMPLATE,
        overrides={},
        end_of_turn_boost=1.0,
    ),
}
CONVERSATIONS = [
    [{"role": "user", "content": "Is this review positive? 'great food, slow service'"}],
    [{"role": "user", "content": "hi"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, and say why in a few words please."},
    ],
    [{"role": "user", "content": "x" * 40}],
    [{"role": "user", "content": "Label: spam or ham? 'WIN A PRIZE NOW'"}],
    [{"role": "user", "content": "Translate 'bonjour'"}],
]
MAX_NEW = 16


def build_chat_checkpoint(path: Path, family: ChatFamily, end_of_turn_boost: float) -> Path:
    """A tiny random `family.arch` model with the family's special tokens, template and EOS set; its LM-head
    row of the end-of-turn token scaled by `end_of_turn_boost`."""
    tok = byte_tokenizer(chat_template=False)
    tok.add_special_tokens({"additional_special_tokens": family.specials}, replace_extra_special_tokens=False)
    tok.bos_token, tok.eos_token = family.bos, family.eos
    tok.chat_template = family.template
    ids = {s: tok.convert_tokens_to_ids(s) for s in family.specials}
    assert min(ids.values()) >= 256 + BYTE_OFFSET and len(tok) == 256 + BYTE_OFFSET + len(family.specials)
    bos, eos, eot = (tok.convert_tokens_to_ids(t) for t in (family.bos, family.eos, family.end_of_turn))
    cfg = tiny_config(
        family.arch,
        vocab_size=len(tok),
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=0,
        **family.overrides,
    )
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    perturb(model)
    with torch.no_grad():
        model.get_output_embeddings().weight[eot] *= end_of_turn_boost
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=[eos, eot], pad_token_id=0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def chat_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    family = FAMILIES[request.param]
    path = build_chat_checkpoint(tmp_path_factory.mktemp(request.param), family, family.end_of_turn_boost)
    return path, request.param


def hf_chat(path: Path, messages: list[dict[str, str]]) -> tuple[str, str, list[int]]:
    """HF's greedy answer: text without special tokens, finish reason, generated ids."""
    tok = AutoTokenizer.from_pretrained(path)
    hf = hf_reference(path)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    out = hf.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=MAX_NEW, do_sample=False,
    )[0, len(ids) :].tolist()  # fmt: skip
    eos = hf.generation_config.eos_token_id
    ended = bool(out) and out[-1] in eos
    if ended:  # generate pads nothing for one sequence; a final EOS is part of what it generated
        assert out.index(out[-1]) == len(out) - 1
    # Random byte tokens may end inside a UTF-8 character: batchq's text never carries such a broken tail
    # (DESIGN: no broken multi-byte characters), HF decodes it as U+FFFD.
    text = tok.decode(out, skip_special_tokens=True).rstrip("\ufffd")
    return text, "eos" if ended else "length", out


def test_chat_answers_and_finish_reasons_equal_hf_on_the_family_template(
    chat_model: tuple[Path, str],
) -> None:
    path, name = chat_model
    family = FAMILIES[name]
    engine = Engine.load(EngineConfig(dtype="float32", model=str(path), kv_cache_gb=0.01, block_size=8))
    convs = [c for c in CONVERSATIONS if not (family.system_refused and c[0]["role"] == "system")]
    params = GenerationParams(temperature=0, max_new_tokens=MAX_NEW)
    results = engine.generate([EngineRequest(f"c{i}", params, messages=c) for i, c in enumerate(convs)])
    tok = AutoTokenizer.from_pretrained(path)
    eot = tok.convert_tokens_to_ids(family.end_of_turn)
    reasons = []
    for conv, res in zip(convs, results, strict=True):
        text, reason, ids = hf_chat(path, conv)
        assert res.token_ids == ids, (name, conv)
        assert (res.text, res.finish_reason) == (text, reason), (name, conv)
        assert family.end_of_turn not in res.text and family.eos not in res.text
        reasons.append((reason, ids[-1] == eot))
    # The test means something only if both endings occur, and some answer ends on the end-of-turn token.
    assert {r for r, _ in reasons} == {"eos", "length"}, reasons
    assert any(on_eot for _, on_eot in reasons), reasons


def test_a_system_message_the_template_refuses_fails_that_request_alone(tmp_path: Path) -> None:
    """Gemma's template raises on a system turn: that request fails with the template's words, the others
    in the batch are answered."""
    path = build_chat_checkpoint(tmp_path, FAMILIES["gemma"], end_of_turn_boost=1.0)
    engine = Engine.load(EngineConfig(dtype="float32", model=str(path), kv_cache_gb=0.01, block_size=8))
    params = GenerationParams(temperature=0, max_new_tokens=4)
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    bad, good = engine.generate(
        [EngineRequest("s", params, messages=system), EngineRequest("u", params, messages=system[1:])]
    )
    assert bad.finish_reason == "error" and bad.error is not None
    assert bad.error.type == "invalid_request" and "System role not supported" in bad.error.message
    assert good.finish_reason in ("eos", "length") and good.completion_tokens > 0
