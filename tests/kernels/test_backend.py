"""select_backend: what one Backend decides for the engine's settings, device and dtypes, once, and what
preparing a model for it (use_backend) does to its layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import build_tiny_checkpoint
from worker.engine_config import EngineConfig
from worker.kernels import native_linear, native_stack
from worker.kernels.backend import BF16_GEMM_ROWS, TORCH_LINEAR, select_backend
from worker.models.layers import RMSNorm
from worker.models.llama import Attention
from worker.models.loader import load_model
from worker.platform import cpu as cpu_platform
from worker.platform.cpu import CpuPlatform

CPU = torch.device("cpu")
needs_c = pytest.mark.skipif(native_stack.library() is None, reason="no C compiler here")


@needs_c
def test_float32_on_the_cpu_runs_every_kernel_in_c() -> None:
    backend = select_backend(EngineConfig(), CPU, torch.float32)
    assert backend.name == "torch" and backend.c_decode
    assert backend.linear.name == "c" and backend.linear.layout == "packed"
    assert backend.rmsnorm is native_linear.rmsnorm and backend.rotary_ is native_linear.rotary_
    assert backend.decode_stack and backend.bf16_gemm_rows == 0
    assert backend.summary == "torch attention with C decode, linear.c, decode stack"
    # a weight linear.c cannot take stays on torch
    assert backend.linear_method(torch.empty(4, 4, dtype=torch.float16)) is TORCH_LINEAR


@needs_c
def test_the_machines_linear_tuning_goes_to_every_method_that_calls_linear_c() -> None:
    tuning = native_linear.LinearTuning(1, 0, native_linear.WIDE_ROWS, 0)
    backend = select_backend(EngineConfig(), CPU, torch.float32, linear_tuning=tuning)
    assert backend.linear_tuning == tuning
    assert backend.linear.tuning == tuning and backend.moe.tuning == tuning  # type: ignore[attr-defined]
    default = select_backend(EngineConfig(), CPU, torch.float32)
    assert default.linear_tuning == native_linear.DEFAULT_TUNING == default.moe.tuning  # type: ignore[attr-defined]


@needs_c
def test_the_decode_stack_setting_keeps_the_other_c_kernels() -> None:
    backend = select_backend(EngineConfig(decode_stack=False), CPU, torch.float32)
    assert not backend.decode_stack and backend.linear.name == "c" and backend.c_decode
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    assert not backend.stack_applies(torch.empty(3, 4, 16, 64), tables, lens)


@needs_c
def test_bfloat16_compute_keeps_c_attention_only() -> None:
    backend = select_backend(EngineConfig(), CPU, torch.bfloat16)
    assert backend.c_decode and backend.linear is TORCH_LINEAR
    assert backend.rmsnorm is None and backend.rotary_ is None and not backend.decode_stack


@pytest.fixture
def bf16_probe(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The platform's bf16 GEMM probe answering "faster", each time it is asked recorded."""
    asked: list[bool] = []

    def speedup(cpu_kernels: str, linear_tuning: object = None) -> float:
        asked.append(True)
        return 2.0

    monkeypatch.setattr(cpu_platform, "cpu_bf16_gemm_speedup", speedup)
    return asked


@needs_c
def test_the_bf16_gemm_threshold_needs_bfloat16_weights_and_fast_bf16_gemms(bf16_probe: list[bool]) -> None:
    fastest = EngineConfig(batch_invariant=False)
    platform = CpuPlatform()
    assert not platform.fast_bf16_gemm(fastest, torch.float32)
    assert select_backend(fastest, CPU, torch.float32, torch.float32, True).bf16_gemm_rows == 0
    assert not bf16_probe  # the probe runs only for bfloat16 weights
    assert platform.fast_bf16_gemm(fastest, torch.bfloat16) and bf16_probe
    backend = select_backend(fastest, CPU, torch.float32, torch.bfloat16, True)
    assert backend.bf16_gemm_rows == BF16_GEMM_ROWS
    assert select_backend(fastest, CPU, torch.float32, torch.bfloat16, False).bf16_gemm_rows == 0
    # a step of that many rows runs layer by layer (oneDNN's GEMM), a smaller one may take the stack
    tables = torch.zeros(BF16_GEMM_ROWS, 1, dtype=torch.int32)
    lens = torch.ones(BF16_GEMM_ROWS, dtype=torch.int32)
    assert not backend.stack_applies(torch.empty(3, 4, 16, 64), tables, lens)


@needs_c
def test_batch_invariance_never_switches_kernels_by_a_steps_rows(bf16_probe: list[bool]) -> None:
    # oneDNN's bf16 GEMM from BF16_GEMM_ROWS rows up would give a row other bits in a prompt-sized step
    # than in a decode-sized one: under batch_invariant (the default) bfloat16 weights stay on linear.c
    assert not CpuPlatform().fast_bf16_gemm(EngineConfig(), torch.bfloat16) and not bf16_probe
    backend = select_backend(EngineConfig(), CPU, torch.float32, torch.bfloat16, True)
    assert backend.bf16_gemm_rows == 0 and backend.linear.name == "c"


def test_torch_kernels_build_nothing_and_run_torch_everywhere() -> None:
    backend = select_backend(EngineConfig(cpu_kernels="torch"), CPU, torch.float32)
    assert not backend.c_decode and backend.linear is TORCH_LINEAR and not backend.decode_stack
    assert backend.rmsnorm is None and backend.rotary_ is None
    assert backend.summary == "torch attention"


@needs_c
def test_use_backend_moves_each_layer_onto_the_backends_kernels(tmp_path: Path) -> None:
    loaded = load_model(str(build_tiny_checkpoint(tmp_path, "llama")), torch.float32, CPU)
    model = loaded.model
    want = [lin.unpacked().clone() for lin in model.linears()]
    assert all(lin.method is TORCH_LINEAR for lin in model.linears())  # as loaded: [out, in], F.linear

    backend = select_backend(EngineConfig(), CPU, torch.float32)
    model.use_backend(backend)

    for lin, w in zip(model.linears(), want, strict=True):
        assert lin.method is backend.linear and lin.weight.dim() == 3  # packed panels
        assert torch.equal(lin.unpacked(), w)
    assert all(m.c_rows is backend.rmsnorm for m in model.modules() if isinstance(m, RMSNorm))
    assert all(m.c_rotary is backend.rotary_ for m in model.modules() if isinstance(m, Attention))

    model.use_backend(select_backend(EngineConfig(cpu_kernels="torch"), CPU, torch.float32))
    for lin, w in zip(model.linears(), want, strict=True):
        assert lin.method is TORCH_LINEAR and torch.equal(lin.weight, w)
    assert all(m.c_rows is None for m in model.modules() if isinstance(m, RMSNorm))


@needs_c
def test_a_float32_prompts_answer_does_not_depend_on_the_prompts_beside_it(tmp_path: Path) -> None:
    # torch's float32 GEMM (MKL) sums a row differently at different row counts, so with it the same text
    # prefilled alone and beside others got different hidden states (an embedding differed in its 7th
    # digit): float32 stays on linear.c, whose answer for a row does not depend on the rows beside it. The
    # same 70-token prompt alone (a 70-row prompt step) and beside 20 other tokens must give the same
    # tokens and logprobs, bit for bit.
    from worker.engine.engine import Engine
    from worker.engine.params import GenerationParams
    from worker.engine.request import EngineRequest

    path = build_tiny_checkpoint(tmp_path / "m", "llama", max_position_embeddings=256)
    # On the CPU, where linear.c runs, also on a machine with a GPU (cuBLAS picks kernels by row count).
    engine = Engine.load(EngineConfig(model=str(path), device="cpu", dtype="float32", kv_cache_gb=0.01))
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 200, (70,), generator=gen).tolist()
    other = torch.randint(3, 200, (20,), generator=gen).tolist()

    def run(prompts: list[list[int]]) -> list[list[tuple[str, float]]]:
        params = GenerationParams(temperature=0, max_new_tokens=6, ignore_eos=True, logprobs=True)
        reqs = [EngineRequest(f"r{i}", params, prompt_token_ids=p) for i, p in enumerate(prompts)]
        return [[(lp.token, lp.logprob) for lp in out.logprobs or []] for out in engine.generate(reqs)]

    (alone,) = run([prompt])
    beside, _ = run([prompt, other])
    assert alone == beside  # bit for bit
