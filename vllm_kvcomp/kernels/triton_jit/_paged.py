"""Shared ``@triton.jit`` helpers: addressing logical tokens in vLLM's paged KV cache."""

import triton
import triton.language as tl


@triton.jit
def token_offsets(bt_row, tok, mask, BLOCK_SIZE: tl.constexpr, stride_blk, stride_tok):
    """Element offsets of the cells of logical tokens ``tok`` [T] of one request.

    ``bt_row`` points at the request's block-table row; token i lives in block
    ``bt_row[i // BLOCK_SIZE]`` at offset ``i % BLOCK_SIZE``. Masked lanes read block 0.
    """
    blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    return blk * stride_blk + (tok % BLOCK_SIZE).to(tl.int64) * stride_tok


@triton.jit
def qk_dot(q, k, DOT_F32: tl.constexpr):
    """q [M, D] · k [N, D]ᵀ -> [M, N] float32.

    ``DOT_F32`` computes in IEEE float32: needed for float32 caches (no TF32) and under the
    Triton interpreter, whose ``tl.dot`` multiplies bfloat16 bit patterns (triton #11584).
    """
    if DOT_F32:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    return tl.dot(q, tl.trans(k.to(q.dtype)))


@triton.jit
def pv_dot(p, v, DOT_F32: tl.constexpr):
    """p [M, N] float32 · v [N, D] -> [M, D] float32 (P cast to V's dtype unless ``DOT_F32``)."""
    if DOT_F32:
        return tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return tl.dot(p.to(v.dtype), v)


@triton.jit
def soft_cap(x, cap):
    """``cap · tanh(x / cap)``, with tanh from exp (the interpreter has no tanh): exact in float32
    for any x (exp overflow gives ±1)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * x / cap) + 1.0))
