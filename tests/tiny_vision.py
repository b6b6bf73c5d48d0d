"""A tiny random Qwen2-VL checkpoint (Qwen2VLForConditionalGeneration saved by transformers: its decoder,
vision tower and merger random, norms and biases perturbed), the byte tokenizer with Qwen2-VL's vision
tokens and a chat template that writes one <|image_pad|> per image part, a preprocessor_config.json with
small pixel bounds, test images, and Hugging Face's float32 generate as the reference."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch

from tests.tiny_models import NORM_NOISE, VOCAB_SIZE, byte_tokenizer

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = VOCAB_SIZE, VOCAB_SIZE + 1, VOCAB_SIZE + 2, VOCAB_SIZE + 3
VL_VOCAB = VOCAB_SIZE + 4
VL_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}</s>\n{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
# patches of 14 px merged 2x2 per token: a 56x56 image is 4x4 patches, 4 tokens; the bounds keep images small
PREPROCESSOR = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16, "patch_size": 14, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.48, 0.46, 0.41], "image_std": [0.27, 0.26, 0.28]}  # fmt: skip


# The Qwen-VL decoders' text config: a tiny Qwen2 with M-RoPE sections over its 8 rotary frequencies
QWEN_TEXT = dict(vocab_size=VL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})  # fmt: skip
VISION_IDS = dict(
    video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END
)


def save_vl(model: Any, path: Path, preprocessor: dict[str, Any]) -> Path:
    """`model` with its norms and biases perturbed, saved beside the vision tokenizer and `preprocessor`."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "ln_q" in name:
                p.add_(torch.randn_like(p) * NORM_NOISE)
    model.save_pretrained(path)
    vl_tokenizer().save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return path


def vl_tokenizer() -> Any:
    tok = byte_tokenizer(chat_template=False)
    tok.add_special_tokens({"additional_special_tokens": ["<unk>", "<s>", "</s>", "<|vision_start|>",
                                                          "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]})  # fmt: skip
    assert tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>"]) == [VISION_START, IMAGE_PAD]
    tok.chat_template = VL_TEMPLATE
    return tok


def build_tiny_qwen2_vl(path: Path, seed: int = 0) -> Path:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen2VLConfig(
        text_config=QWEN_TEXT, image_token_id=IMAGE_PAD, tie_word_embeddings=False, **VISION_IDS,
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3, initializer_range=0.2),
    )  # fmt: skip
    return save_vl(Qwen2VLForConditionalGeneration(cfg), path, PREPROCESSOR)


def png(width: int, height: int, seed: int) -> bytes:
    """A random RGB image as PNG bytes."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def hf_vl(path: Path) -> Any:
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_vl_generate(hf: Any, ids: list[int], pixel_values: torch.Tensor | None, grids: torch.Tensor | None,
                   n: int) -> list[int]:  # fmt: skip
    """HF's greedy tokens after the expanded prompt `ids` with the images' patches (None: text only)."""
    input_ids = torch.tensor([ids])
    kwargs: dict[str, Any] = {}
    if pixel_values is not None:
        kwargs = {"pixel_values": pixel_values, "image_grid_thw": grids,
                  "mm_token_type_ids": (input_ids == IMAGE_PAD).int()}  # fmt: skip
    out = hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n,
                      do_sample=False, **kwargs)  # fmt: skip
    return [int(t) for t in out[0, len(ids) :]]


@torch.no_grad()
def hf_vl_logprobs(
    hf: Any, ids: list[int], pixel_values: torch.Tensor | None, grids: torch.Tensor | None
) -> torch.Tensor:
    """log_softmax of HF's logits at every position of `ids`: [len, vocab]."""
    input_ids = torch.tensor([ids])
    kwargs: dict[str, Any] = {}
    if pixel_values is not None:
        kwargs = {"pixel_values": pixel_values, "image_grid_thw": grids,
                  "mm_token_type_ids": (input_ids == IMAGE_PAD).int()}  # fmt: skip
    return torch.log_softmax(hf(input_ids=input_ids, **kwargs).logits[0].float(), dim=-1)


LLAVA_PREPROCESSOR = {"size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28},
                      "image_mean": [0.48, 0.46, 0.41], "image_std": [0.27, 0.26, 0.28]}  # fmt: skip


def build_tiny_llava(path: Path, seed: int = 0) -> Path:
    """A tiny random LLaVA-1.5 (LlavaForConditionalGeneration: a 2-layer CLIP tower of 28 px images in 14 px
    patches, so 4 tokens an image, a projector and a Llama decoder), with the vision tokenizer (its image
    placeholder is <|image_pad|>) and a preprocessor_config.json for its PIL image processor."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=28, patch_size=14, projection_dim=32)  # fmt: skip
    text = LlamaConfig(vocab_size=VL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2)  # fmt: skip
    cfg = LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=IMAGE_PAD,
                      vision_feature_layer=-2, vision_feature_select_strategy="default", image_seq_length=4,
                      tie_word_embeddings=False)  # fmt: skip
    return save_vl(LlavaForConditionalGeneration(cfg), path, LLAVA_PREPROCESSOR)


def build_tiny_qwen2_5_vl(path: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2.5-VL: Qwen2-VL's decoder and processor, its tower windowed (windows of 56 px,
    full attention in its last block)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen2_5_VLConfig(
        text_config=QWEN_TEXT, image_token_id=IMAGE_PAD, tie_word_embeddings=False, **VISION_IDS,
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           window_size=56, fullatt_block_indexes=[1], initializer_range=0.2),
    )  # fmt: skip
    return save_vl(Qwen2_5_VLForConditionalGeneration(cfg), path, PREPROCESSOR)
