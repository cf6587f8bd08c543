"""Test-only helpers around the package's decode reference: reference pairs and the tolerance.

The reference itself is :func:`vllm_kvcomp.kernels.reference.decode_reference` and the random
paged cache is :mod:`vllm_kvcomp.kernels.fixtures`. A kernel's output is compared with the
reference run on float64 inputs; :func:`assert_close_to_ref` sets the tolerance from PyTorch's own
error: the same reference run on the test dtype's inputs against the float64 run.
"""

from __future__ import annotations

import torch

from vllm_kvcomp.kernels.fixtures import Paged
from vllm_kvcomp.kernels.reference import Compensation, decode_reference

Result = tuple[torch.Tensor, torch.Tensor]


def decode_refs(
    q: torch.Tensor,
    paged: Paged,
    starts: torch.Tensor | None,
    compensation: Compensation | None,
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[Result, Result]:
    """The reference (out, lse) on float64 inputs and on the test dtype's inputs, on the CPU."""
    cpu = paged.cpu()
    sinks = None if sinks is None else sinks.cpu()
    args = (cpu.block_table, cpu.seq_lens, starts, compensation, scale, softcap, sinks)
    exact = decode_reference(q.cpu().double(), cpu.cache.double(), *args)
    low = decode_reference(q.cpu(), cpu.cache, *args)
    return exact, low


def assert_decode_close(
    q: torch.Tensor,
    paged: Paged,
    starts: torch.Tensor | None,
    compensation: Compensation | None,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    what: str = "",
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """A kernel's out [B, H_q, D] (q's dtype) and lse [B, H_q] float32 match the reference."""
    (o64, l64), (o_lp, l_lp) = decode_refs(q, paged, starts, compensation, scale, softcap, sinks)
    assert out.dtype == q.dtype and lse.dtype == torch.float32, (out.dtype, lse.dtype)
    assert_close_to_ref(out, o64, o_lp, what=f"out {what}")
    assert_close_to_ref(lse, l64, l_lp, what=f"lse {what}")


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| over finite-and-equal-aware entries (matching infinities count as 0)."""
    diff = (a.double() - b.double()).abs()
    same = a.double() == b.double()  # handles equal infinities
    return (
        float(torch.where(same, torch.zeros_like(diff), diff).nan_to_num(0.0).max())
        if diff.numel()
        else 0.0
    )


def assert_close_to_ref(
    actual: torch.Tensor,
    ref64: torch.Tensor,
    ref_lp: torch.Tensor,
    factor: float = 4.0,
    what: str = "",
) -> None:
    """``actual`` within ``factor`` × (PyTorch's own error ``|ref_lp - ref64|``) of ``ref64``.

    An absolute floor of one ulp of ``actual``'s dtype at the reference's magnitude covers
    references that happen to be exact.
    """
    lp_err = max_abs_err(ref_lp, ref64)
    finite = ref64[torch.isfinite(ref64)]
    magnitude = float(finite.abs().max()) if finite.numel() else 1.0
    dtype = actual.dtype if actual.dtype.is_floating_point else torch.float32
    atol = factor * lp_err + torch.finfo(dtype).eps * max(magnitude, 1.0)
    torch.testing.assert_close(
        actual.double().cpu(),
        ref64.double().cpu(),
        atol=atol,
        rtol=0.0,
        equal_nan=True,
        msg=lambda m: (
            f"{what}: {m}\n(PyTorch's own {ref_lp.dtype} error {lp_err:.3g}, atol {atol:.3g})"
        ),
    )
