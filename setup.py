"""Build hook beside pyproject.toml, which holds all package metadata.

Adds the optional CUDA extension ``vllm_kvcomp._C`` (``csrc/``) when torch is a CUDA build and
nvcc is found. Build isolation hides torch, so build it with
``pip install --no-build-isolation .`` in the serving environment; any other install builds the
pure-Python package (the Triton kernels under ``vllm_kvcomp/kernels/triton_jit`` are plain modules of
it). ``VLLM_KVCOMP_BUILD_CUDA=0`` skips the extension, ``=1`` makes a missing toolchain an error.
``TORCH_CUDA_ARCH_LIST`` picks the GPU architectures.
"""

from __future__ import annotations

import os

from setuptools import setup

CUDA_SOURCES = ["csrc/bindings.cpp", "csrc/decode_attention.cu"]


def cuda_build_options() -> dict:
    """``ext_modules``/``cmdclass`` for the CUDA extension, or nothing when it cannot be built."""
    mode = os.environ.get("VLLM_KVCOMP_BUILD_CUDA", "auto")
    if mode == "0":
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        torch = None
    if torch is None or torch.version.cuda is None or CUDA_HOME is None:
        if mode == "1":
            raise RuntimeError(
                "VLLM_KVCOMP_BUILD_CUDA=1 needs a CUDA build of torch and nvcc "
                "(and pip install --no-build-isolation so the build sees torch)"
            )
        return {}
    extension = CUDAExtension(
        "vllm_kvcomp._C",
        sources=CUDA_SOURCES,
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


setup(**cuda_build_options())
