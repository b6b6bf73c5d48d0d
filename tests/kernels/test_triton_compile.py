"""The Triton kernels compile for Hopper, checked on any machine (the interpreter checks far less)."""

from __future__ import annotations

import pytest

from tests.kernels.conftest import PTXAS, in_fresh_process


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build ships no ptxas")
def test_kernels_compile_to_sm90_cubins() -> None:
    in_fresh_process("-m", "tests.kernels.hopper_compile")
