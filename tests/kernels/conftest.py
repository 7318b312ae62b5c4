"""Kernel tests run in Triton's interpreter on a CPU and natively on a GPU (``-m gpu``).

``@triton.jit`` decides interpreted vs compiled when a function is *defined*, Triton's own
standard library included, so the interpreter must be selected before ``triton`` is first
imported: here, at collection (nothing imports triton earlier in this suite). One process runs
one mode; if something imported triton first, the CPU kernel tests fail and say so.
"""

import os
import sys

import pytest
import torch

TRITON_IMPORTED_FIRST = "triton" in sys.modules and "TRITON_INTERPRET" not in os.environ
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

# Every kernel test takes ``device``: "cpu" runs the interpreter, "cuda" (marked gpu) the GPU.
DEVICES = [pytest.param("cpu", id="interp"), pytest.param("cuda", id="gpu", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    if request.param == "cpu":
        if not INTERPRETED:
            pytest.skip("kernels are compiled for the GPU in this process; CPU runs need TRITON_INTERPRET=1")
        if TRITON_IMPORTED_FIRST:
            pytest.fail(
                "triton was imported (compiled mode) before tests/kernels/conftest.py selected the interpreter: "
                "run `TRITON_INTERPRET=1 pytest ...` or the kernel tests in a process of their own"
            )
    if request.param == "cuda" and (INTERPRETED or not torch.cuda.is_available()):
        pytest.skip("needs a CUDA GPU and TRITON_INTERPRET unset")
    return request.param
