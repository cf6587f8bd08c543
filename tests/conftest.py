"""Markers resolved in one place: ``gpu`` needs CUDA, ``vllm`` needs vLLM installed (the GPU
machine runs the vLLM-free kernel and cache tests without it), ``slow`` needs --run-slow.

Without a GPU, Triton kernels run in Triton's CPU interpreter. ``TRITON_INTERPRET`` is read when
a jit function is decorated — Triton's own ``tl.cdiv`` too, at ``import triton`` — so it is set
here, before any test module (or vLLM, which imports Triton) is imported.
"""

from __future__ import annotations

import importlib.util
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
    vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "vllm" in item.keywords and not vllm:
            item.add_marker(pytest.mark.skip(reason="needs vLLM (not installed on this machine)"))
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: pass --run-slow"))
