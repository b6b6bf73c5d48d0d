"""A tiny random Llama GGUF file written with gguf's own writer, for tests: a byte-level tokenizer in its
metadata, a tied Q8_0 embedding (batchq's quantised LM head) and, per layer, linears in the formats batchq
reads (K-quants and legacy quants; parts of one fused projection in different formats). Its dimensions are
the smallest whose every linear takes a K-quant's 256-value super-blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from worker.engine.detokenizer import bytes_to_unicode
from worker.models import gguf_quants

HIDDEN, INTER, HEADS, KV_HEADS = 256, 512, 4, 2
# per layer, GGUF's tensor -> its type: layer 0's q/k/v mix Q4_K and Q6_K (batchq widens them to 8-bit q in
# groups of 16); layer 1's the legacy quants and a Q5_K
TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
     "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
    {"attn_q": "Q4_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_1", "ffn_gate": "Q4_1",
     "ffn_up": "Q4_1", "ffn_down": "Q5_K"},
]  # fmt: skip
# gguf's numpy quantisers have no K-quants: their blocks are random bytes, with the float16 scales (at these
# byte offsets) kept small, so that the weights are of a trained model's size
K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
SPECIALS = ["<unk>", "<s>", "</s>"]


def _k_blocks(rng: np.random.Generator, type_name: str, n: int, k: int) -> np.ndarray:
    size, values = gguf_quants.BLOCKS[type_name]
    raw = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    for at in K_SCALES[type_name]:
        f = (rng.standard_normal((n, k // values)) * 2e-4).astype(np.float16)
        raw[..., at : at + 2] = f[..., None].view(np.uint8).reshape(n, k // values, 2)
    return raw.reshape(n, -1)


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """The file at `path`; returns `path`."""
    import gguf
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(len(TYPES))
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    chars = bytes_to_unicode()
    tokens = [*SPECIALS, *(chars[b] for b in range(256)), "he", "th"]  # an odd vocabulary: a share padded
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(["h e", "t h"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def add(name: str, shape: tuple[int, int] | tuple[int], type_name: str, std: float = 0.1) -> None:
        if type_name == "F32":  # a norm's weight
            w.add_tensor(name, (1 + std * rng.standard_normal(shape)).astype(np.float32))
            return
        if type_name in K_SCALES:
            data = _k_blocks(rng, type_name, *shape)
        else:
            data = quantize(
                (std * rng.standard_normal(shape)).astype(np.float32), GGMLQuantizationType[type_name]
            )
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType[type_name])

    add("token_embd.weight", (len(tokens), HIDDEN), "Q8_0")
    add("output_norm.weight", (HIDDEN,), "F32")
    d = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * d, HIDDEN), "attn_v": (KV_HEADS * d, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
              "ffn_down": (HIDDEN, INTER)}  # fmt: skip
    for i, types in enumerate(TYPES):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), "F32")
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), "F32")
        for t, shape in shapes.items():
            add(f"blk.{i}.{t}.weight", shape, types[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
