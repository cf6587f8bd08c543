"""CriticalKV's projected-value L1 norms: the fused Triton kernel (interpreted on CPU, compiled on a
GPU) against the plain float64 sum, over dtypes, head dims, group sizes, lengths and the strides
of a transposed view of the model's output projection; the torch path's blocking; the dispatch."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cases import DEVICE, INTERPRET
from vllm_kvcomp import kernels
from vllm_kvcomp.kernels.reference import projected_l1_norms_reference

TRITON = ["triton"] if INTERPRET or DEVICE == "cuda" else []


def _inputs(hk: int, group: int, n: int, d: int, hidden: int, seed: int = 0):
    """values [H_kv, N, D] and weight [H_q, D, hidden] as the worker hands them: a view of the
    model's ``o_proj.weight`` [hidden, H_q·D] (hidden is the slow axis of the view)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(hk, n, d, generator=gen, dtype=torch.float64)
    o_proj = torch.randn(hidden, hk * group * d, generator=gen, dtype=torch.float64) * d**-0.5
    return values, o_proj.t().reshape(hk * group, d, hidden)  # reshape of a transposed view: a view


def _plain(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[H_kv, N] float64, one (head, token) at a time."""
    hk, n, _ = values.shape
    group = weight.shape[0] // hk
    out = torch.zeros(hk, n, dtype=torch.float64)
    for h in range(hk):
        for i in range(n):
            out[h, i] = sum((values[h, i] @ weight[h * group + g]).abs().sum() for g in range(group)) / group
    return out


@pytest.mark.parametrize("backend", TRITON)
@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(("hk", "group", "n", "d", "hidden"), [
    (2, 4, 70, 64, 96),    # hidden not a multiple of the block: masked columns
    (1, 3, 1, 128, 40),    # one token, group 3
    (3, 1, 33, 48, 64),    # head dim not a power of two: masked channels
])
def test_triton_equals_the_plain_sum(backend, dtype, rtol, hk, group, n, d, hidden):
    values, weight = _inputs(hk, group, n, d, hidden)
    expected = _plain(values.to(dtype).double(), weight.to(dtype).double())  # the inputs' own rounding
    got = kernels.projected_l1_norms(values.to(DEVICE, dtype), weight.to(DEVICE, dtype), backend=backend)
    assert got.dtype == torch.float32 and got.shape == (hk, n)
    torch.testing.assert_close(got.cpu().double(), expected, rtol=rtol, atol=0)


@pytest.mark.parametrize("backend", TRITON)
def test_triton_blocks_of_any_size_give_the_same_norms(backend):
    from vllm_kvcomp.kernels.triton_jit.projected import projected_l1_norms as triton_norms

    values, weight = (t.to(DEVICE, torch.float32) for t in _inputs(2, 2, 50, 64, 80, seed=3))
    one = triton_norms(values, weight, block_n=16, block_o=16)
    torch.testing.assert_close(triton_norms(values, weight, block_n=64, block_o=128), one, rtol=1e-5, atol=0)


def test_reference_is_the_plain_sum_in_blocks_of_any_size():
    values, weight = _inputs(2, 3, 16, 4, 5, seed=1)
    expected = _plain(values, weight)
    torch.testing.assert_close(projected_l1_norms_reference(values, weight), expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(projected_l1_norms_reference(values, weight, block=1), expected, rtol=1e-12, atol=0)


def test_dispatch_multiplies_in_the_asked_dtype_and_keeps_float64_on_torch():
    values, weight = _inputs(1, 2, 9, 8, 16, seed=2)
    exact = kernels.projected_l1_norms(values, weight)  # float64: the torch path, float64 sums
    assert exact.dtype == torch.float64
    torch.testing.assert_close(exact, _plain(values, weight), rtol=1e-12, atol=0)
    as32 = kernels.projected_l1_norms(values, weight, torch.float32, backend="torch")
    assert as32.dtype == torch.float32
    torch.testing.assert_close(as32.double(), exact, rtol=1e-5, atol=0)
    with pytest.raises(RuntimeError, match="CUDA extension"):
        kernels.projected_l1_norms(values, weight, backend="cuda")
    assert kernels.resolve_backend("projected_l1_norms", torch.device("cpu")) == "torch"
    assert kernels.resolve_backend("projected_l1_norms", torch.device("cuda")) == "triton"
