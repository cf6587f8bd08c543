"""Kernel tests: Triton kernels run compiled on CUDA tensors when a GPU is present, else in
Triton's CPU interpreter. ``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set
here, before any test module imports ``vllm_kvcomp.triton_kernels``."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
