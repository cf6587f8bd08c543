"""Launcher of the projected-value L1 norms (CriticalKV's second-stage factor)."""

from __future__ import annotations

import torch
import triton

from vllm_kvcomp.kernels.triton_jit._projected import _projected_l1_kernel
from vllm_kvcomp.kernels.triton_jit.utils import SUPPORTED_DTYPES, dot_f32


def projected_l1_norms(values: torch.Tensor, weight: torch.Tensor, block_n: int = 128,
                       block_o: int = 128) -> torch.Tensor:
    """[H_kv, N] float32 ``mean_{q ∈ G(h)} ||v_i W_o^q||₁`` of values [H_kv, N, D] and weight
    [H_q, D, hidden] (any strides, e.g. a transposed view of the model's ``o_proj`` weight), both
    of one dtype: the product in it on tensor cores (IEEE float32 for float32), accumulated and
    summed in float32, one launch."""
    hk, n, d = values.shape
    hq, wd, hidden = weight.shape
    if wd != d or hq % hk:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit values {tuple(values.shape)}")
    if values.dtype not in SUPPORTED_DTYPES or weight.dtype != values.dtype:
        raise ValueError(f"values and weight must share one of {SUPPORTED_DTYPES}, got {values.dtype}, {weight.dtype}")
    out = torch.empty(hk, n, dtype=torch.float32, device=values.device)
    if n == 0:
        return out
    block_d = max(16, triton.next_power_of_2(d))
    block_n = max(16, min(block_n, triton.next_power_of_2(n)))
    block_o = max(16, min(block_o, triton.next_power_of_2(hidden)))
    _projected_l1_kernel[(hk, triton.cdiv(n, block_n))](
        values, weight, out, n, hidden,
        *values.stride(), *weight.stride(), out.stride(0),
        GROUP=hq // hk, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_O=block_o,
        DOT_F32=dot_f32(values.dtype), num_warps=8 if block_n * block_o >= 128 * 128 else 4,
    )
    return out
