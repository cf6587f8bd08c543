"""``@triton.jit`` body of the projected-value L1 norms (CriticalKV's ``||v W_o||₁``), fused: the
product tile never leaves the registers."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _projected_l1_kernel(
    v_ptr, w_ptr, out_ptr,
    N, HIDDEN,
    s_vh, s_vn, s_vd,
    s_wq, s_wd, s_wo,
    s_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_O: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Program (h, n-block): out[h, n] = mean_{g < GROUP} Σ_o |Σ_d v[h, n, d] · w[h·GROUP + g, d, o]|."""
    h = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    v = tl.load(v_ptr + h * s_vh + rows[:, None] * s_vn + dims[None, :] * s_vd,
                mask=(rows[:, None] < N) & (dims[None, :] < HEAD_DIM), other=0.0)
    if DOT_F32:
        v = v.to(tl.float32)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in range(GROUP):
        w_head = w_ptr + (h * GROUP + g) * s_wq
        for start in range(0, HIDDEN, BLOCK_O):
            cols = start + tl.arange(0, BLOCK_O)
            w = tl.load(w_head + dims[:, None] * s_wd + cols[None, :] * s_wo,
                        mask=(dims[:, None] < HEAD_DIM) & (cols[None, :] < HIDDEN), other=0.0)
            if DOT_F32:
                prod = tl.dot(v, w.to(tl.float32), input_precision="ieee")
            else:
                prod = tl.dot(v, w.to(v.dtype))
            total += tl.sum(tl.abs(prod), axis=1)
    tl.store(out_ptr + h * s_oh + rows, total / GROUP, mask=rows < N)
