"""GGUF files keep their quantisation in the native decoder (gguf_weights.py): SmolLM2's own Q4_1 file, and
the same model rewritten with mixed formats (fused projections whose parts differ, so batchq re-expresses
them in the widest), compute exactly what the model computes with Hugging Face's dequantisation of the same
file: the same greedy tokens and bit-for-bit the same logits, through the C kernels and the decode stack."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest
from worker.engine_config import EngineConfig
from worker.models.resolve import gguf_checkpoint, smollm2_gguf_path

pytestmark = pytest.mark.slow

# a Q4_K_M-like mixture: within one fused projection, parts of other widths and group formats; in the first
# MIXED_LAYERS layers only (gguf's numpy quantisers take seconds a layer; the rest stay Q4_1)
MIXED_LAYERS = 3
MIXED = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q4_0", "ffn_gate": "Q8_0", "ffn_down": "Q5_1"}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Label this review as positive or negative: 'slow service, cold food'"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


def requantised(src: Path, dest: Path, types: dict[str, str], layers: int) -> Path:
    """`src` rewritten with the tensors of its first `layers` layers whose names contain a key of `types`
    re-quantised to its format (from gguf's dequantisation of the original), every metadata field copied
    (gguf's own writer)."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dest), arch=str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8"))
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        ours = t.name.startswith(tuple(f"blk.{i}." for i in range(layers)))
        target = next(
            (GGMLQuantizationType[v] for k, v in types.items() if ours and f".{k}." in t.name), None
        )
        data, qtype = t.data, t.tensor_type
        if target is not None:
            data, qtype = quantize(dequantize(t.data, t.tensor_type), target), target
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


def engine_on(model: str) -> Engine:
    return Engine.load(EngineConfig(model=model, dtype="float32", kv_cache_gb=0.3))


def same_computation(quantised: Engine, dequantised: Engine) -> None:
    params = GenerationParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    a = quantised.generate([EngineRequest(f"c{i}", params, messages=m) for i, m in enumerate(CHATS)])
    b = dequantised.generate([EngineRequest(f"c{i}", params, messages=m) for i, m in enumerate(CHATS)])
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    for e in (quantised, dequantised):  # one prefill step's logits, batch of the three chats
        for i, m in enumerate(CHATS):
            e.add_request(EngineRequest(f"p{i}", GenerationParams(max_new_tokens=2), messages=m))
        e._intake()
    steps = [e.scheduler.schedule() for e in (quantised, dequantised)]
    assert all(s is not None for s in steps)
    la, lb = (e.model_runner.compute_logits(s) for e, s in zip((quantised, dequantised), steps, strict=True))  # type: ignore[arg-type]
    assert torch.equal(la, lb)


def test_smollm2s_q4_1_file_computes_its_dequantised_weights_bit_for_bit() -> None:
    quantised = engine_on("smollm2-135m")
    model = quantised.model_runner.model
    kept = [lin for lin in model.linears() if lin.bits]
    assert len(kept) == len(model.linears())  # every projection, and the tied head (Q8_0), stay quantised
    assert model.lm_head.bits == 8 and model.layers[0].self_attn.qkv_proj.bits == 4  # type: ignore[union-attr]
    assert quantised.model_runner.backend.decode_stack
    same_computation(quantised, engine_on(str(gguf_checkpoint(smollm2_gguf_path()))))


def test_a_file_of_mixed_formats_keeps_each_and_widens_mixed_fused_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gguf

    path = requantised(smollm2_gguf_path(), tmp_path / "mixed.gguf", MIXED, MIXED_LAYERS)
    parses: list[str] = []
    real = gguf.GGUFReader

    def counted(p: str, mode: str = "r") -> gguf.GGUFReader:
        parses.append(str(p))
        return real(p, mode)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    quantised = engine_on(str(path))
    # a new file's config and tokenizer come from one decoding of its metadata, seconds each (resolve.py)
    assert parses == [str(path)]
    layer = quantised.model_runner.model.layers[0]
    qkv, gate_up, down = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj  # type: ignore[union-attr]
    assert (qkv.bits, qkv.group) == (8, 32) and qkv.group_table.dtype == torch.float16  # Q5_0 + Q4_0 as 8-bit
    assert (gate_up.bits, gate_up.group) == (8, 32)  # Q8_0 + Q4_1
    assert down.bits == 8  # Q5_1 on its own
    assert quantised.model_runner.model.layers[MIXED_LAYERS].self_attn.qkv_proj.bits == 4  # type: ignore[union-attr]  # Q4_1 as it was
    reference = gguf_checkpoint(path)
    assert parses == [str(path)] * 2  # the dequantised checkpoint's tokenizer, config and weights: one more
    same_computation(quantised, engine_on(str(reference)))
