"""Fixtures for the kernel tests: which device, and with it whether triton interprets; the
compiled CPU kernels (`kernel`).

On the CPU the kernels run in triton's interpreter. `TRITON_INTERPRET` is set per test with
monkeypatch rather than at import time, so nothing outside tests/kernels ever sees it; that works
because the kernel modules wrap their kernels with `triton.jit` lazily, once per interpreter
mode (`triton_launch.jitted`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest
import torch

from node_agent.engine.kernels import cpu_kernels


@pytest.fixture(params=["cpu", "cuda"])
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[torch.device]:
    """`cpu`: interpreted kernels (always runs). `cuda`: compiled kernels (needs a GPU)."""
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device: the compiled kernels are covered by the interpreter run")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield torch.device(request.param)


@pytest.fixture
def kernel() -> ctypes.CDLL:
    """The compiled CPU kernels; the test is skipped where they cannot serve."""
    lib = cpu_kernels.library()
    if lib is None:
        pytest.skip("the compiled CPU kernel cannot serve on this machine (no AVX-512F or no C compiler)")
    return lib
