"""Triton kernels of vllm-kvcomp, installed as ``vllm_kvcomp.triton_kernels``.

The source folder is the top-level ``triton_kernels/`` of the repository, but vLLM imports
OpenAI's own top-level ``triton_kernels`` (MoE kernels) and only falls back to its vendored copy
when that import fails. Run from the repository root, this folder would shadow it, so importing it
under the top-level name raises ``ImportError`` and vLLM's fallback stays intact.

Modules: ``_*.py`` hold the ``@triton.jit`` bodies, the others the launchers (shape checks, grids).
"""

if __name__ == "triton_kernels":
    raise ImportError(
        "this is vllm-kvcomp's kernel folder (import it as vllm_kvcomp.triton_kernels), "
        "not OpenAI's triton_kernels"
    )
