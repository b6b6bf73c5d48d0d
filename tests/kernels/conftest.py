"""Kernel tests run on a GPU when there is one, else on the CPU under the Triton interpreter.

triton.jit picks interpreter or compiler when a kernel module is imported, so TRITON_INTERPRET must be
set before worker.kernels.triton_attention is first imported: this conftest sets it at its own import.
If another test imported the kernels earlier (pytest collects other folders first), the session fixture
below rebuilds them for the interpreter.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:  # before triton is imported: it reads the setting then
    os.environ["TRITON_INTERPRET"] = "1"
_TRITON = importlib.util.find_spec("triton")
assert _TRITON is not None and _TRITON.origin is not None, "the kernel tests need triton"
PTXAS = Path(_TRITON.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"  # Hopper compiles need it
ROOT = Path(__file__).resolve().parents[2]

_KERNEL_MODULES = ("triton_cache", "triton_decode", "triton_prefill", "triton_invariant", "triton_attention")


@pytest.fixture(scope="session")
def kernels() -> ModuleType:
    """worker.kernels.triton_attention, built for the interpreter when there is no GPU."""
    mod = importlib.import_module("worker.kernels.triton_attention")
    if not ON_GPU and not mod.interpreted():
        for name in _KERNEL_MODULES:  # kernel modules first: triton_attention reads them at call time
            importlib.reload(sys.modules[f"worker.kernels.{name}"])
    assert mod.available(), "Triton kernels cannot run here"
    return mod


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")


def in_fresh_process(*argv: str) -> None:
    """`python argv` run from the repository without TRITON_INTERPRET, and succeeding: this process may
    have built the kernels for the interpreter, which accepts what the compiler rejects."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences triton 3.9's warning about the coming default
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
