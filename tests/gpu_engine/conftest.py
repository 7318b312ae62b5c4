"""Fixtures for the engine tests: tiny random checkpoints saved by ``transformers`` itself
(built by ``tiny_models``, which the test modules import too).

Like tests/kernels, Triton kernels run in the interpreter on a CPU: the switch must be set
before any module defines a ``@triton.jit`` kernel.
"""

import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from tiny_models import FAMILIES, make_checkpoint  # noqa: E402 (after the interpreter switch)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> (directory, HF model) built once per session."""
    out = {}
    for fam in FAMILIES:
        d = tmp_path_factory.mktemp(fam)
        out[fam] = (d, make_checkpoint(fam, d))
    return out
