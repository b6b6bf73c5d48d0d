"""What decides an engine's outputs, in one digest: weights, dtype, numerics, output-shaping settings,
and the tokenizer and chat template that turn a request's text into tokens.

Two engines with the same fingerprint give the same text for the same request (greedy, or sampled
with a seed), so a result computed by one may answer a request sent to the other: the result cache
(producer/wire/result_cache.py) is keyed by it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
import torch
from torch import nn

# Bump when a change to the engine alters any output for the same weights, dtype and request (a kernel
# that rounds differently, a sampler change, a stop-rule change): cached results then miss.
# 2: cascade decode attention over shared prefix blocks; 3: choices results carry their logprobs;
# 4: batch invariance by default (no cascade, no bf16 GEMM threshold, a CPU's bfloat16 computed in float32).
NUMERICS_VERSION = 4
SAMPLES_PER_TENSOR = 4096


@torch.inference_mode()
def weights_digest(model: nn.Module) -> str:
    """A digest of every weight tensor's name, shape, dtype and an evenly strided sample of its values.

    A sample, not every byte: hashing an 8B model would take seconds at start-up, and any real change
    of weights (another checkpoint, a fine-tune, another quantisation) moves the sampled values.
    """
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(model.state_dict().items()):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // SAMPLES_PER_TENSOR)
        sample = flat[::step][:SAMPLES_PER_TENSOR].float().cpu().contiguous()
        h.update(f"{name}\0{tuple(t.shape)}\0{t.dtype}\0".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    """A digest of the tokenizer (vocabulary, merges, normalisation, special tokens) and chat template."""
    h = hashlib.blake2b(digest_size=16)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer serialises all of itself
        h.update(backend.to_str().encode())
    else:
        h.update(orjson.dumps(sorted(tokenizer.get_vocab().items())))
    h.update(str(getattr(tokenizer, "chat_template", None) or "").encode())
    h.update(
        orjson.dumps(getattr(tokenizer, "special_tokens_map", {}), default=str, option=orjson.OPT_SORT_KEYS)
    )
    return h.hexdigest()


def engine_fingerprint(weights: str, **settings: object) -> str:
    """The digest of the weights, NUMERICS_VERSION and the settings that shape outputs."""
    blob = orjson.dumps(
        {"weights": weights, "numerics": NUMERICS_VERSION, **settings}, option=orjson.OPT_SORT_KEYS
    )
    return hashlib.blake2b(blob, digest_size=16).hexdigest()
