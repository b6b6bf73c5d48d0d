"""The C decode stack (decode_stack.c): a whole decode step in one call computes what the layer-by-layer
path computes, for every Llama-family variant (Gemma 2 / 3 too), weight and cache dtype it takes, and steps aside where it
does not apply. Tiny random checkpoints through the production loader; HF parity of the same decode
steps is tests/engine/test_tiny_models.py's (the engine runs the stack there)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.tiny_models import build_tiny_checkpoint
from worker.engine.engine import Engine
from worker.engine.params import GenerationParams
from worker.engine.request import EngineRequest
from worker.engine.scheduler import ScheduledBatch
from worker.engine_config import EngineConfig
from worker.kernels import native_linear, native_stack
from worker.kernels.linear_methods import PackedLinear

pytestmark = pytest.mark.skipif(native_stack.library() is None, reason="no C compiler here")

ARCHS = {
    "llama-biased": ("llama", {"attention_bias": True, "mlp_bias": True}),  # q/k/v/o and MLP biases
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),  # q/k/v biases only
    "qwen3": ("qwen3", {"head_dim": 32}),  # per-head q/k RMSNorm, head_dim != hidden / heads
    "mha": ("llama", {"num_key_value_heads": 4}),  # one query head per kv head
    "llama-gelu": ("llama", {"hidden_act": "gelu"}),  # the exact GELU
    # (1 + w) norms around both sublayers, GELU-tanh, soft-caps, a window; Gemma 3's q/k norms and its
    # sliding layers' own rotary table
    "gemma2": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 64, "attn_logit_softcapping": 4.0,
                          "sliding_window": 12, "attention_bias": True}),
    "gemma3": ("gemma3", {"head_dim": 16, "sliding_window": 10, "num_hidden_layers": 3,
                          "sliding_window_pattern": 3, "rope_local_base_freq": 100.0}),
}  # fmt: skip
# contexts from one token to several blocks (block_size 8), so rows straddle block edges
PROMPTS = [[5], list(range(10, 47)), [200, 100] * 20, [42, 43, 44, 45, 46, 47, 48], list(range(3, 120, 2))]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = ARCHS[request.param]
    return build_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)


def load(path: Path, weight_dtype: str = "auto", kv_cache_dtype: str = "auto", **kw: object) -> Engine:
    cfg = EngineConfig(
        dtype="float32",
        model=str(path),
        kv_cache_gb=0.01,
        block_size=8,
        weight_dtype=weight_dtype,
        kv_cache_dtype=kv_cache_dtype,
        **kw,  # type: ignore[arg-type]
    )
    return Engine.load(cfg)


def decode_batch(engine: Engine, prompts: list[list[int]]) -> ScheduledBatch:
    """Prefill `prompts`, append each one's greedy token, and return the decode step that follows."""
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"p{i}", GenerationParams(max_new_tokens=4), prompt_token_ids=p))
    engine._intake()
    prefill = engine.scheduler.schedule()
    assert prefill is not None and prefill.phase == "prefill" and len(prefill.seqs) == len(prompts)
    first = engine.model_runner.compute_logits(prefill).argmax(-1).tolist()
    assert engine.scheduler.computed(prefill) == prefill.seqs
    for seq, t in zip(prefill.seqs, first, strict=True):
        seq.output_ids.append(t)
    batch = engine.scheduler.schedule()
    assert batch is not None and batch.phase == "decode"
    return batch


def both_paths(engine: Engine, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """The step's logits and KV caches after it, through the stack and layer by layer, each from the
    same caches."""
    runner = engine.model_runner
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    stacked = runner.compute_logits(batch)
    assert runner.model._stack is not None and runner.model._stack[1] is not None, "the stack did not run"
    caches_stacked = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
        k.copy_(k0)
        v.copy_(v0)
    backend = runner.backend
    assert backend.decode_stack
    runner.backend = dataclasses.replace(backend, decode_stack=False)  # the same kernels, layer by layer
    try:
        layered = runner.compute_logits(batch)
    finally:
        runner.backend = backend
    return stacked, layered, caches_stacked, [(k.clone(), v.clone()) for k, v in runner.kv_caches]


def new_slots(batch: ScheduledBatch, block_size: int) -> list[tuple[int, int]]:
    """(block, offset) of each sequence's token written by the step."""
    out = []
    for seq, table in zip(batch.seqs, batch.block_tables, strict=True):
        pos = seq.num_tokens - 1
        out.append((table[pos // block_size], pos % block_size))
    return out


@pytest.mark.parametrize(
    ("weight_dtype", "kv_cache_dtype"),
    [
        ("float32", "auto"),
        ("float32", "bfloat16"),
        ("bfloat16", "auto"),
        ("int8", "bfloat16"),
        ("float32", "fp8_e4m3"),  # K/V divided by calibrated per-layer scales
    ],
)
def test_stack_computes_the_layer_by_layer_step(
    checkpoint: Path, weight_dtype: str, kv_cache_dtype: str
) -> None:
    engine = load(checkpoint, weight_dtype, kv_cache_dtype)
    batch = decode_batch(engine, PROMPTS)
    stacked, layered, caches_s, caches_l = both_paths(engine, batch)
    # The same kernels in the same order; only the SiLU's exponential differs (by ~1 float32 rounding),
    # which a bfloat16 cache may round to values one bfloat16 step apart in later layers.
    # (an FP8 step is 2^-3 relative: a value one FP8 step apart moves the logits more)
    tol = {"bfloat16": 1e-2, "fp8_e4m3": 5e-2}.get(kv_cache_dtype, 1e-4)
    torch.testing.assert_close(stacked, layered, rtol=tol, atol=tol)
    assert stacked.argmax(-1).tolist() == layered.argmax(-1).tolist()
    slots = new_slots(batch, 8)
    for layer, ((ks, vs), (kl, vl)) in enumerate(zip(caches_s, caches_l, strict=True)):
        for block, off in slots:
            got = torch.stack([ks[:, block, off], vs[:, block, off]]).float()
            want = torch.stack([kl[:, block, off], vl[:, block, off]]).float()
            assert not torch.isnan(got).any()
            if layer == 0:  # nothing differs before the first MLP: bit for bit
                assert torch.equal(got, want)
            else:  # ~1e-7 apart before rounding; a narrow cache may round them one step apart
                tol = {torch.bfloat16: 2**-7, torch.float8_e4m3fn: 2**-3}.get(ks.dtype, 1e-4)
                torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        # the step wrote only its own slots
        ks_other, kl_other = ks.clone(), kl.clone()
        for block, off in slots:
            ks_other[:, block, off] = 0
            kl_other[:, block, off] = 0
        assert torch.equal(ks_other.float().nan_to_num(), kl_other.float().nan_to_num())


def test_one_sequence_and_many(checkpoint: Path) -> None:
    """Batch 1 (one thread busy in the per-row phases) and a batch of more rows than threads."""
    for prompts in ([PROMPTS[1]], [[100 + i, *p] for i in range(4) for p in PROMPTS]):
        engine = load(checkpoint, max_num_seqs=32, max_num_batched_tokens=4096)
        batch = decode_batch(engine, prompts)
        stacked, layered, _, _ = both_paths(engine, batch)
        torch.testing.assert_close(stacked, layered, rtol=1e-4, atol=1e-4)


def test_generation_through_the_stack_equals_layer_by_layer(checkpoint: Path) -> None:
    def run(decode_stack: bool) -> list[list[int]]:
        engine = load(checkpoint, decode_stack=decode_stack)
        assert engine.model_runner.backend.decode_stack == decode_stack
        reqs = [
            EngineRequest(f"g{i}", GenerationParams(temperature=0, max_new_tokens=24), prompt_token_ids=p)
            for i, p in enumerate(PROMPTS)
        ]
        return [r.token_ids for r in engine.generate(reqs)]

    assert run(decode_stack=True) == run(decode_stack=False)


def test_fp8_rounding_is_torchs() -> None:
    """decode_stack.c writes FP8 as torch's CPU cast does: nearest even, saturating at +-448."""
    lib = native_stack.library()
    assert lib is not None
    gen = torch.Generator().manual_seed(0)
    patterns = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64)
    x = torch.cat(
        [
            patterns.to(torch.int32).view(torch.float32),  # every exponent, subnormals, inf and NaN
            torch.randn(1 << 18, generator=gen) * 0.01,  # FP8 subnormals and their rounding
            torch.randn(1 << 18, generator=gen) * 300,  # the saturating edge
            torch.tensor(
                [0.0, -0.0, 448.0, 464.0, 479.99, 480.0, -480.0, 2**-6, 2**-9, 2**-10, float("inf")]
            ),
        ]
    )
    got = torch.empty(x.numel(), dtype=torch.uint8)
    lib.batchq_to_fp8(x.data_ptr(), got.data_ptr(), x.numel())
    want = x.to(torch.float8_e4m3fn)
    nan = x.isnan()
    assert torch.equal(got[~nan], want.view(torch.uint8)[~nan])
    assert got[nan].view(torch.float8_e4m3fn).float().isnan().all()


def test_calibration_steps_aside(tmp_path: Path) -> None:
    """FP8 calibration's pass (kv_absmax) records every layer's K/V, so it runs layer by layer, even on a
    decode step the stack would take, and computes what the layer-by-layer step computes."""
    path = build_tiny_checkpoint(tmp_path / "llama", "llama")
    engine = load(path)
    batch = decode_batch(engine, PROMPTS[:2])
    runner = engine.model_runner
    model = runner.model
    step = runner.decode_inputs(batch.seqs, batch.block_tables)
    model._stack = None
    absmax = model.kv_absmax(step.input_ids, step.positions, step.meta, runner.kv_caches, runner.backend)
    assert model._stack is None  # never consulted
    assert len(absmax) == model.spec.num_layers and all(k > 0 and v > 0 for k, v in absmax)
    assert all(torch.isfinite(torch.tensor(absmax)).flatten())


@pytest.mark.parametrize("invariant", [False, True])
def test_a_shared_prefix_keeps_cascade_attention_unless_batch_invariant(
    tmp_path: Path, invariant: bool
) -> None:
    """Sequences holding the same cached prefix blocks decode with cascade attention (faster there), so
    the step runs layer by layer; under batch invariance (the default) cascade, whose sums follow the
    sequences that share the prefix, never runs, and the step stays in the stack."""
    path = build_tiny_checkpoint(tmp_path / "llama", "llama")
    engine = load(path, batch_invariant=invariant)
    shared = list(range(3, 83))  # 80 tokens: 10 full blocks, above cascade's 64-token minimum
    engine.generate(
        [EngineRequest("warm", GenerationParams(max_new_tokens=1), prompt_token_ids=[*shared, 9])]
    )
    batch = decode_batch(engine, [[*shared, 5, 6], [*shared, 7]])
    runner = engine.model_runner
    assert batch.block_tables[0][:10] == batch.block_tables[1][:10]
    runner.model._stack = None
    logits = runner.compute_logits(batch)
    # not consulted where the backend said the step is not plain (cascade's)
    assert (runner.model._stack is not None) == invariant
    assert runner.backend.decode_stack
    k_cache = runner.kv_caches[0][0]
    tables = runner.decode_inputs(batch.seqs, batch.block_tables).meta
    assert runner.backend.stack_applies(k_cache, tables.block_tables, tables.context_lens) == invariant
    assert torch.isfinite(logits).all()


def with_bf16_gemm_rows(engine: Engine, rows: int) -> None:
    """What select_backend chooses on a CPU with fast bf16 GEMMs, at `rows` rows."""
    runner = engine.model_runner
    runner.backend = dataclasses.replace(runner.backend, linear=PackedLinear(rows))
    runner.model.use_backend(runner.backend)


def test_bf16_gemm_rows_take_the_torch_path(tmp_path: Path) -> None:
    """bfloat16 weights on a CPU with fast bf16 GEMMs: steps of bf16_gemm_rows rows or more run oneDNN's
    GEMM layer by layer; smaller ones the stack."""
    path = build_tiny_checkpoint(tmp_path / "llama", "llama")
    engine = load(path, weight_dtype="bfloat16")
    with_bf16_gemm_rows(engine, 2)
    model = engine.model_runner.model
    assert all(lin.method.bf16_gemm_rows == 2 for lin in model.linears())  # type: ignore[attr-defined]
    engine.model_runner.compute_logits(decode_batch(engine, PROMPTS[:1]))
    assert model._stack is not None and model._stack[1] is not None
    engine = load(path, weight_dtype="bfloat16")
    with_bf16_gemm_rows(engine, 2)
    model = engine.model_runner.model
    engine.model_runner.compute_logits(decode_batch(engine, PROMPTS[1:3]))
    assert model._stack is None


def test_linear_c_tuning_reaches_the_stack_and_changes_no_answer(tmp_path: Path) -> None:
    """The backend's tuning goes to every linear.c call of the stack; the step's logits are the same bits
    under any tuning (in the AVX2 build every knob bites; elsewhere the prefetch hint)."""
    engine = load(build_tiny_checkpoint(tmp_path / "llama", "llama"))
    batch = decode_batch(engine, PROMPTS)
    runner, model = engine.model_runner, engine.model_runner.model
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    default = runner.compute_logits(batch)
    for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
        k.copy_(k0)
        v.copy_(v0)
    tuning = native_linear.LinearTuning(1, 1, native_linear.WIDE_ROWS, native_linear.PACE_ROWS)
    runner.backend = dataclasses.replace(runner.backend, linear_tuning=tuning)
    model._stack = None  # built again, from the new backend
    assert torch.equal(runner.compute_logits(batch), default)
    assert model._stack is not None and model._stack[1] is not None and model._stack[1]._tuning == tuning


WINDOWED = {
    "mistral-window-5": ("mistral", {"sliding_window": 5}),  # every layer, narrower than a block
    "qwen2-full-then-windowed": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 11, "max_window_layers": 1, "num_hidden_layers": 3},
    ),
}


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_stack_computes_windowed_and_softcapped_layers_as_layer_by_layer(tmp_path: Path, name: str) -> None:
    """Each layer's sliding window and an attention-logit softcap reach decode_stack.c's layers: the stack's
    step equals the layer-by-layer step, which paged_decode.c computes within the same windows. (The softcap
    is set on the decoder's layers here; Gemma 2's own, from its config, runs in ARCHS.)"""
    arch, overrides = WINDOWED[name]
    engine = load(build_tiny_checkpoint(tmp_path / name, arch, **overrides))
    model = engine.model_runner.model
    assert isinstance(model.spec.layer_windows, tuple) and any(w is not None for w in model.layer_windows)
    for attn in model.attentions():
        attn.softcap = 3.0
    batch = decode_batch(engine, PROMPTS)
    stacked, layered, _, _ = both_paths(engine, batch)
    torch.testing.assert_close(stacked, layered, rtol=1e-4, atol=1e-4)
    assert model._stack is not None and model._stack[1] is not None
    assert [x.window for x in model._stack[1]._keep[0]] == list(model.layer_windows)


def test_a_shared_prefix_beyond_every_window_keeps_the_stack(tmp_path: Path) -> None:
    """Cascade attention cannot run in a layer whose window cuts the contexts, so where every layer's does,
    sequences sharing a cached prefix still decode through the stack."""
    engine = load(build_tiny_checkpoint(tmp_path / "mistral", "mistral", sliding_window=16))
    shared = list(range(3, 83))  # 80 tokens of shared prefix, five windows
    engine.generate(
        [EngineRequest("warm", GenerationParams(max_new_tokens=1), prompt_token_ids=[*shared, 9])]
    )
    batch = decode_batch(engine, [[*shared, 5, 6], [*shared, 7]])
    runner = engine.model_runner
    meta = runner.decode_inputs(batch.seqs, batch.block_tables).meta
    assert batch.block_tables[0][8:10] == batch.block_tables[1][8:10]  # the blocks the window reaches
    assert runner.backend.stack_applies(runner.kv_caches[0][0], meta.block_tables, meta.context_lens, 16)
    runner.model._stack = None
    runner.compute_logits(batch)
    assert runner.model._stack is not None and runner.model._stack[1] is not None


def quantize_in_place(engine: Engine, kind: str) -> None:
    """Every linear layer of the loaded model kept quantised, as a checkpoint would ship it: 4-bit or 8-bit
    groups of 32 input rows (min-max, float16 or float32 scales and offsets), or FP8 E4M3 with a scale per
    output."""
    model = engine.model_runner.model
    for lin in model.linears():
        w = lin.dequantized(torch.float32)
        n, k = w.shape
        if kind == "fp8":
            scale = w.abs().amax(1).clamp_min(1e-8) / 448.0
            lin.load((w / scale[:, None]).to(torch.float8_e4m3fn), lin.bias, scale=scale)
            continue
        bits, table = (4, torch.float16) if kind == "q4" else (8, torch.float32)
        wg = w.view(n, k // 32, 32)
        lo, hi = wg.amin(-1), wg.amax(-1)
        top = (1 << bits) - 1
        s = ((hi - lo) / top).clamp_min(1e-8)
        z = torch.round(-lo / s)
        q = torch.clamp(torch.round(wg / s[..., None]) + z[..., None], 0, top).view(n, k)
        q = q.to(torch.uint8) if bits == 4 else (q - 128).to(torch.int8)
        o = s * (z if bits == 4 else z - 128)
        lin.load_groups(q, s.to(table), o.to(table), 32, bits)
    model._stack = None


@pytest.mark.parametrize("kind", ["q4", "q8", "fp8"])
def test_stack_computes_the_layer_by_layer_step_on_quantised_weights(checkpoint: Path, kind: str) -> None:
    engine = load(checkpoint)
    quantize_in_place(engine, kind)
    batch = decode_batch(engine, PROMPTS)
    stacked, layered, _, _ = both_paths(engine, batch)
    assert engine.model_runner.model.lm_head.bits == (0 if kind == "fp8" else int(kind[1]))
    torch.testing.assert_close(stacked, layered, rtol=1e-4, atol=1e-4)
    assert stacked.argmax(-1).tolist() == layered.argmax(-1).tolist()
