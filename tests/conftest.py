"""Markers resolved in one place: ``gpu`` needs CUDA, ``slow`` needs --run-slow.

Without a GPU, Triton kernels run in Triton's CPU interpreter. ``TRITON_INTERPRET`` is read when
a jit function is decorated — Triton's own ``tl.cdiv`` too, at ``import triton`` — so it is set
here, before any test module (or vLLM, which imports Triton) is imported.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--run-slow")
    cuda = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: pass --run-slow"))
