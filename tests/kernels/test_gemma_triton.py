"""Gemma 2 / 3 on the GPU path's attention: the native decoder (loaded by the production loader) with the
Triton kernels (on a GPU, else under the Triton interpreter) and F.linear, as select_backend gives a CUDA
device, over prompts longer than the local layers' windows: prefill and decode logits equal Hugging Face
float32's. The same torch code runs with the CPU kernels in tests/engine/test_tiny_models.py."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.tiny_models import build_tiny_checkpoint, hf_reference
from worker.kernels.backend import TORCH_LINEAR, Backend, triton_attention
from worker.models.layers import AttentionMetadata
from worker.models.llama import LlamaFamilyModel
from worker.models.loader import load_model

BLOCK = 16
MODELS = {
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 64, "attn_logit_softcapping": 4.0,
               "final_logit_softcapping": 3.0, "sliding_window": 12, "attention_bias": True},
    "gemma3": {"head_dim": 16, "sliding_window": 10, "num_hidden_layers": 3, "sliding_window_pattern": 3,
               "rope_local_base_freq": 100.0},
}  # fmt: skip


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_gemma_through_triton_attention_equals_hf(
    arch: str, tmp_path: Path, kernels: ModuleType, device: torch.device
) -> None:
    path = build_tiny_checkpoint(tmp_path, arch, **MODELS[arch])
    loaded = load_model(str(path), torch.float32, device)
    model = loaded.model
    assert isinstance(model, LlamaFamilyModel) and any(w is not None for w in model.layer_windows)
    backend = Backend(triton_attention(), TORCH_LINEAR)
    model.use_backend(backend)
    s = model.spec
    caches = [
        tuple(
            torch.zeros(backend.attention.kv_cache_shape(8, BLOCK, s.num_kv_heads, s.head_dim), device=device)
            for _ in range(2)
        )
        for _ in range(s.num_layers)
    ]
    hf = hf_reference(path)
    prompt = list(range(10, 50))  # 40 tokens: past both windows, three blocks
    n = len(prompt)
    table = torch.arange(8, dtype=torch.int32, device=device)[None]
    prefill = AttentionMetadata(
        "prefill",
        slot_mapping=torch.arange(n, device=device),
        block_tables=table,
        context_lens=torch.tensor([n], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
    )
    ids = torch.tensor(prompt, device=device)
    with torch.inference_mode():
        hidden = model(ids, torch.arange(n, device=device), prefill, caches, backend)  # type: ignore[arg-type]
        ours_prefill = model.compute_logits(hidden).cpu()
        nxt = int(ours_prefill[-1].argmax())
        decode = AttentionMetadata(
            "decode",
            slot_mapping=torch.tensor([n], device=device),
            block_tables=table,
            context_lens=torch.tensor([n + 1], dtype=torch.int32, device=device),
        )
        step = model(
            torch.tensor([nxt], device=device), torch.tensor([n], device=device), decode, caches, backend
        )  # type: ignore[arg-type]
        ours_decode = model.compute_logits(step).cpu()
        ref = hf(torch.tensor([[*prompt, nxt]])).logits[0]
    torch.testing.assert_close(ours_prefill, ref[:-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours_decode[0], ref[-1], rtol=1e-4, atol=1e-4)
