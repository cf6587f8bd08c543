"""Build hooks beside pyproject.toml, which holds all package metadata.

1. Ships the top-level ``triton_kernels/`` folder as ``vllm_kvcomp.triton_kernels`` (the
   ``package-dir`` mapping in pyproject.toml names its folder, but ``packages.find`` only lists
   packages found under their own name, so the package is added to the list here).
2. Adds the optional CUDA extension ``vllm_kvcomp._C`` (``csrc/``) when torch is a CUDA build
   and nvcc is found. Build isolation hides torch, so build it with
   ``pip install --no-build-isolation .`` in the serving environment; any other install builds
   the pure-Python package. ``VLLM_KVCOMP_BUILD_CUDA=0`` skips the extension, ``=1`` makes a
   missing toolchain an error. ``TORCH_CUDA_ARCH_LIST`` picks the GPU architectures.
"""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.dist import Distribution

KERNEL_PACKAGE = "vllm_kvcomp.triton_kernels"
CUDA_SOURCES = ["csrc/bindings.cpp", "csrc/compaction.cu", "csrc/decode_attention.cu"]


class KvcompDistribution(Distribution):
    """Adds the renamed kernel package after pyproject.toml's ``packages.find`` ran."""

    def parse_config_files(self, *args, **kwargs):
        super().parse_config_files(*args, **kwargs)
        if self.packages is not None and KERNEL_PACKAGE not in self.packages:
            self.packages.append(KERNEL_PACKAGE)


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


setup(distclass=KvcompDistribution, **cuda_build_options())
