"""Tiny random Llama-family checkpoints and a byte-level tokenizer, for tests and benchmarks only.

Checkpoints are real HF directories (save_pretrained), so they go through the production loader. Their norm
weights and biases are random too: Hugging Face initialises them to ones and zeros, which would hide a norm
or bias that is loaded into the wrong place, or not at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from worker.engine.detokenizer import bytes_to_unicode

BYTE_OFFSET = 3  # ids 0..2 are <unk>, <s>, </s>; byte b is id b + 3
VOCAB_SIZE = 256 + BYTE_OFFSET
EOS_ID = 2
NORM_NOISE = 0.1  # the spread added to every norm weight and bias
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def byte_tokenizer(chat_template: bool = True) -> Any:
    """A byte-level BPE tokenizer with no merges: every UTF-8 byte is one token (so CJK spans tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    byte_chars = bytes_to_unicode()
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({byte_chars[b]: b + BYTE_OFFSET for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.add_special_tokens({"additional_special_tokens": specials})
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


# A reasoning model's tokenizer: the byte tokenizer plus <think> and </think> (ids THINK, END_THINK; a
# model for it needs vocab_size=THINK_VOCAB_SIZE). Its template opens thinking in the prompt where
# `open_thinking` is set (DeepSeek-R1's), closes it there with enable_thinking=false (Qwen3's), else
# leaves it to the model; reasoning_effort, where given, lands in the prompt.
THINK, END_THINK = VOCAB_SIZE, VOCAB_SIZE + 1
THINK_VOCAB_SIZE = VOCAB_SIZE + 2
THINK_TEMPLATE = (
    "{% if reasoning_effort is defined %}<s>system\nReasoning: {{ reasoning_effort }}</s>\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif open_thinking is defined and open_thinking %}<think>\n{% endif %}{% endif %}"
)


def think_tokenizer() -> Any:
    fast = byte_tokenizer(chat_template=False)
    fast.add_special_tokens({"additional_special_tokens": ["<unk>", "<s>", "</s>", "<think>", "</think>"]})
    assert fast.convert_tokens_to_ids(["<think>", "</think>"]) == [THINK, END_THINK]
    fast.chat_template = THINK_TEMPLATE
    return fast


def tiny_config(arch: str, **overrides: Any) -> Any:
    """A small config of `arch` (llama | qwen2 | qwen3 | mistral | granite | olmo2 | phi3 | gemma2 | gemma3
    (its text model), the mixture-of-experts mixtral | qwen2_moe | qwen3_moe | gpt_oss (their expert counts in
    `overrides`), and cohere | cohere2 | starcoder2 | gemma, which run through the transformers fallback) with
    peaky random logits."""
    from transformers import (
        Cohere2Config,
        CohereConfig,
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        GptOssConfig,
        GraniteConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Olmo2Config,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        Starcoder2Config,
    )

    common: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        tie_word_embeddings=False,
        initializer_range=0.2,  # peaky distributions: random greedy paths without near-ties
    )
    common.update(overrides)
    classes = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "mistral": MistralConfig,
        "granite": GraniteConfig,
        "olmo2": Olmo2Config,
        "phi3": Phi3Config,
        "cohere": CohereConfig,
        "cohere2": Cohere2Config,
        "starcoder2": Starcoder2Config,
        "gemma": GemmaConfig,
        "gemma2": Gemma2Config,
        "gemma3": Gemma3TextConfig,
        "mixtral": MixtralConfig,
        "qwen2_moe": Qwen2MoeConfig,
        "qwen3_moe": Qwen3MoeConfig,
        "gpt_oss": GptOssConfig,
    }
    return classes[arch](**common)


def perturb(model: torch.nn.Module) -> None:
    """Add NORM_NOISE-wide random values to every norm weight, bias (of every kind: gpt-oss's experts' too)
    and attention sink: HF initialises them to 1 and 0, which would hide a loader that drops them."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("bias", ".sinks")):
                param.add_(torch.randn_like(param) * NORM_NOISE)


def build_tiny_checkpoint(
    path: Path, arch: str, seed: int = 0, chat_template: bool = True, **overrides: Any
) -> Path:
    """Save a random tiny `arch` model plus the byte tokenizer to `path`; returns `path`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    perturb(model)
    model.save_pretrained(path)
    byte_tokenizer(chat_template).save_pretrained(path)
    return path


OPEN = {"open_thinking": True}  # THINK_TEMPLATE's variable: the prompt opens the thinking (DeepSeek-R1's way)
THINK_ASK = [{"role": "user", "content": "Is the food good?"}]


def think_prompt_ids(tok: Any, **kwargs: Any) -> list[int]:
    """THINK_ASK through THINK_TEMPLATE with the generation prompt."""
    text = tok.apply_chat_template(THINK_ASK, tokenize=False, add_generation_prompt=True, **kwargs)
    return list(tok(text, add_special_tokens=False).input_ids)


def hf_reference(path: Path | str, dtype: torch.dtype = torch.float32) -> Any:
    """Hugging Face's model of a checkpoint, as the tests' reference: eager attention, the only one of HF's
    that applies Gemma 2's attention-logit soft-capping (transformers 5.17 picks sdpa for Gemma 2 by
    default, which skips it and answers as an uncapped model)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


@torch.no_grad()
def hf_greedy(hf: Any, ids: list[int], n: int, forced: dict[int, int] | None = None) -> list[int]:
    """HF's greedy continuation (up to EOS, included), with `forced` tokens {output index: id} in place of
    what it would pick there."""
    out: list[int] = []
    while len(out) < n:
        logits = hf(torch.tensor([ids + out])).logits[0, -1]
        token = (forced or {}).get(len(out), int(logits.argmax()))
        out.append(token)
        if token == EOS_ID:
            break
    return out


def build_think_checkpoint(path: Path, seed: int = 9) -> Path:
    """A tiny random Qwen3 with think_tokenizer whose greedy decoding of THINK_ASK thinks on its own: the
    output rows of <think> and </think> are scaled copies of those of tokens its greedy path takes (where it
    would have written its first token, and a token it first writes some steps later)."""
    from transformers import AutoModelForCausalLM

    build_tiny_checkpoint(path, "qwen3", seed=seed, vocab_size=THINK_VOCAB_SIZE)
    tok = think_tokenizer()
    tok.save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    plain = hf_greedy(hf, think_prompt_ids(tok), 1)
    head = hf.lm_head.weight
    with torch.no_grad():
        head[THINK] = head[plain[0]] * 1.05
    opened = hf_greedy(hf, think_prompt_ids(tok, **OPEN), 24)
    closer = next(t for i, t in enumerate(opened) if i >= 6 and t not in opened[:i] and t != plain[0])
    with torch.no_grad():
        head[END_THINK] = head[closer] * 1.05
    hf.save_pretrained(path)
    return path


def build_tiny_gemma3_image_text(path: Path, seed: int = 0, **text_overrides: Any) -> Path:
    """A random tiny Gemma 3 image-text checkpoint (Gemma3ForConditionalGeneration: a one-layer SigLIP
    vision tower and projector beside the text decoder, tied as its top-level config says) plus the byte
    tokenizer; its image token ids are the last byte ids, which the tests' prompts leave out."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    torch.manual_seed(seed)
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14,
    )  # fmt: skip
    cfg = Gemma3Config(
        text_config=tiny_config("gemma3", **text_overrides).to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=VOCAB_SIZE - 1,
        boi_token_index=VOCAB_SIZE - 2,
        eoi_token_index=VOCAB_SIZE - 3,
    )
    model = Gemma3ForConditionalGeneration(cfg)
    perturb(model)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path
