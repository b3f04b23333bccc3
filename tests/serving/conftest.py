"""The serving tests share the kernel tests' `device` fixture: on the CPU the triton kernels run
under `TRITON_INTERPRET=1`, set per test; with a GPU the same cases also run compiled."""

from tests.kernels.conftest import device

__all__ = ["device"]
