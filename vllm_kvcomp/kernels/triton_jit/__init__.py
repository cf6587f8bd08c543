"""Triton paged decode attention (``decode.decode_attention``), called by ``vllm_kvcomp.kernels``.

``_*.py`` hold the ``@triton.jit`` bodies, ``decode.py`` the launcher (shape checks, grids),
``utils.py`` the launcher-side helpers. ``vllm_kvcomp.kernels`` imports the launcher only at the
first Triton call, because ``TRITON_INTERPRET`` is read when a kernel is decorated. The folder is
not named ``triton`` so that ``import triton`` here can only mean OpenAI's Triton, for readers and
for import-sorting tools alike (docs/kernels.md).
"""
