"""The Triton prefill kernel over packed pages (causal varlen rows, one KV head and G query heads
per sequence) vs the package's plain-PyTorch reference run in float64, in Triton's interpreter on
CPU; the reference itself vs eq. 5 written per sequence with its causal mask."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.helpers.kernel_refs import assert_close_to_ref
from tests.kernels.cases import DEVICE
from vllm_kvcomp.kernels.fixtures import Paged, make_paged
from vllm_kvcomp.kernels.reference import prefill_reference
from vllm_kvcomp.kernels.triton_jit.decode import decode_attention
from vllm_kvcomp.kernels.triton_jit.prefill import prefill_attention
from vllm_kvcomp.policies.compensation import compensated_attention

#: (cells, query rows) per sequence: a decode row, a whole prompt (T = its length) longer than one
#: 64-lane tile at G = 1, a chunk over a longer prefix, rows of a cell count that is a multiple of
#: 16, a sequence without rows, draft-like rows; lengths mostly not multiples of the block size
SEQUENCES = [(37, 1), (70, 70), (100, 30), (48, 3), (25, 0), (17, 5)]


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    head_dim: int
    block_size: int
    group: int
    softcap: float  # 0 = off
    sinks: bool
    comp: bool  # compensation tokens on (one sequence with count 0)

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        flags = "".join(f"-{n}" for n, on in (("cap", self.softcap), ("sinks", self.sinks), ("comp", self.comp)) if on)
        return f"{dt}-d{self.head_dim}-bs{self.block_size}-g{self.group}{flags}"


CASES = [
    Case(torch.float32, 64, 16, 1, 0.0, False, False),
    Case(torch.float32, 80, 16, 3, 5.0, True, True),
    Case(torch.float16, 64, 32, 3, 0.0, False, True),
    Case(torch.bfloat16, 80, 16, 5, 8.0, True, False),
    Case(torch.float16, 80, 16, 8, 0.0, True, True),
]


@dataclass
class Inputs:
    paged: Paged
    q: torch.Tensor  # [T_total, G, D]
    query_start: torch.Tensor  # [S + 1] int32
    comp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # k_hat, v_hat [S, D], counts [S]
    sinks: torch.Tensor | None  # [S, G]


def _inputs(case: Case, sequences: list[tuple[int, int]], seed: int = 0) -> Inputs:
    lengths = [n for n, _ in sequences]
    paged = make_paged(lengths, 1, case.head_dim, case.block_size, case.dtype, DEVICE, seed=seed)
    rows = torch.tensor([t for _, t in sequences])
    query_start = torch.cat([torch.zeros(1, dtype=torch.long), rows.cumsum(0)]).to(torch.int32)
    gen = torch.Generator().manual_seed(seed + 10)
    s, d = len(sequences), case.head_dim
    q = torch.randn(int(rows.sum()), case.group, d, generator=gen).to(case.dtype)
    comp = None
    if case.comp:
        counts = torch.randint(1, 50, (s,), generator=gen).float()
        counts[1] = 0.0  # the whole prompt without a token
        comp = (torch.randn(s, d, generator=gen), torch.randn(s, d, generator=gen), counts)
    sinks = torch.randn(s, case.group, generator=gen) if case.sinks else None
    return Inputs(paged, q.to(DEVICE), query_start.to(DEVICE), comp, sinks)


def _dev(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(DEVICE)


def _run(case: Case, x: Inputs, max_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    k_hat, v_hat, counts = x.comp if x.comp is not None else (None, None, None)
    p = x.paged
    return prefill_attention(x.q, p.cache, p.block_table, p.seq_lens, x.query_start, _dev(k_hat), _dev(v_hat),
                             _dev(counts), softcap=case.softcap, sinks=_dev(x.sinks), max_rows=max_rows)


def _assert_matches_reference(case: Case, x: Inputs, out: torch.Tensor, lse: torch.Tensor) -> None:
    """out/lse within PyTorch's own low-precision error of the float64 reference."""
    p = x.paged.cpu()
    args = (p.block_table, p.seq_lens, x.query_start.cpu(), x.comp, None, case.softcap, x.sinks)
    o64, l64 = prefill_reference(x.q.cpu().double(), p.cache.double(), *args)
    o_lp, l_lp = prefill_reference(x.q.cpu(), p.cache, *args)
    assert out.dtype == case.dtype and lse.dtype == torch.float32, (out.dtype, lse.dtype)
    assert out.shape == x.q.shape and lse.shape == x.q.shape[:2]
    assert_close_to_ref(out, o64, o_lp, what=f"out {case}")
    assert_close_to_ref(lse, l64, l_lp, what=f"lse {case}")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_prefill_matches_reference(case: Case) -> None:
    x = _inputs(case, SEQUENCES)
    out, lse = _run(case, x)
    _assert_matches_reference(case, x, out, lse)
    assert torch.isfinite(out).all()  # NaN-poisoned cells past each length are never read


@pytest.mark.parametrize("group", [1, 3, 5])
def test_single_rows_match_the_decode_kernel(group: int) -> None:
    """T = 1 everywhere (a 16- or 32-lane tile from ``max_rows``): the decode kernel's result."""
    case = Case(torch.float32, 80, 16, group, 5.0, True, True)
    x = _inputs(case, [(37, 1), (1, 1), (64, 1), (100, 1)], seed=2)
    out, lse = _run(case, x, max_rows=1)
    _assert_matches_reference(case, x, out, lse)
    k_hat, v_hat, counts = (t.unsqueeze(1).to(DEVICE) for t in x.comp)
    p = x.paged
    want_out, want_lse = decode_attention(x.q, p.cache, p.block_table, p.seq_lens, None, k_hat, v_hat, counts,
                                          num_splits=3, softcap=case.softcap, sinks=_dev(x.sinks))
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_tile_size_does_not_change_the_result() -> None:
    """``max_rows`` only sizes the tile: a 16-lane tile on long rows gives the 64-lane result."""
    case = Case(torch.float32, 64, 16, 3, 0.0, True, True)
    x = _inputs(case, SEQUENCES, seed=4)
    out, lse = _run(case, x, max_rows=1)
    want_out, want_lse = _run(case, x)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_first_row_of_a_whole_prompt_sees_its_first_cell_only() -> None:
    """Row 0 of a sequence whose T equals its length attends cell 0 alone: out = v_0."""
    case = Case(torch.float32, 64, 16, 3, 0.0, False, False)
    x = _inputs(case, [(40, 40)], seed=5)
    out, lse = _run(case, x)
    keys, values = x.paged.cpu().kv(0)
    torch.testing.assert_close(out[0].cpu(), values[0, 0].expand(3, -1))
    torch.testing.assert_close(lse[0].cpu(), (x.q[0].cpu() @ keys[0, 0]) * 64**-0.5)


def test_no_rows_gives_empty_outputs() -> None:
    case = Case(torch.float32, 64, 16, 2, 0.0, False, False)
    x = _inputs(case, [(10, 0), (5, 0)])
    out, lse = _run(case, x)
    assert out.shape == (0, 2, 64) and lse.shape == (0, 2)


def test_rejects_a_cache_of_several_kv_heads() -> None:
    case = Case(torch.float32, 64, 16, 2, 0.0, False, False)
    x = _inputs(case, [(10, 2)])
    two_heads = make_paged([10], 2, 64, 16, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="one KV head"):
        prefill_attention(x.q, two_heads.cache, two_heads.block_table, two_heads.seq_lens, x.query_start)


def test_rejects_query_start_of_the_wrong_length() -> None:
    case = Case(torch.float32, 64, 16, 2, 0.0, False, False)
    x = _inputs(case, [(10, 2), (7, 1)])
    p = x.paged
    with pytest.raises(ValueError, match="query_start"):
        prefill_attention(x.q, p.cache, p.block_table, p.seq_lens, x.query_start[:-1])


def test_reference_equals_eq5_per_sequence() -> None:
    """``prefill_reference`` on float64 equals eq. 5 per sequence with the bottom-right causal
    mask, its keys read cell by cell through the table (``Paged.kv``)."""
    case = Case(torch.float64, 16, 16, 3, 4.0, True, True)
    x = _inputs(case, SEQUENCES, seed=6)
    p = x.paged.cpu()
    q, query_start = x.q.cpu(), x.query_start.cpu()
    out, lse = prefill_reference(q, p.cache, p.block_table, p.seq_lens, query_start, x.comp, 0.3, 4.0, x.sinks)
    assert out.dtype == lse.dtype == torch.float64
    k_hat, v_hat, counts = (c.double() for c in x.comp)
    for s, (n, t) in enumerate(SEQUENCES):
        rows = slice(int(query_start[s]), int(query_start[s + 1]))
        keys, values = (c[0].unsqueeze(1).expand(-1, 3, -1) for c in p.kv(s))  # [n, G, D]
        mask = torch.arange(n).view(1, n) < (n - t + 1 + torch.arange(t)).view(t, 1)
        want = compensated_attention(q[rows], keys, values, k_hat[s].expand(3, -1), v_hat[s].expand(3, -1),
                                     counts[s].expand(3), 0.3, mask, 4.0, x.sinks[s])
        torch.testing.assert_close(out[rows], want, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(lse).all()
