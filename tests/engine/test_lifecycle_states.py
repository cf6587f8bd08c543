"""The worker side of a request's lifecycle (vllm_kvcomp/engine/lifecycle.py) without vLLM:
every legal path, and an illegal transition is an error, never a silent state."""

from __future__ import annotations

import pytest
import torch

from vllm_kvcomp.engine.lifecycle import IllegalTransition, Lifecycle, Phase
from vllm_kvcomp.engine.state import QueryWindow


def test_prompt_end_then_decode_and_recompressions():
    life = Lifecycle()
    assert life.phase is Phase.PREFILL and not life.compression_pending
    life.prompt_complete(100)
    assert life.phase is Phase.PROMPT_END and life.prompt_end == 100 and life.compression_pending
    life.compressed()
    assert life.phase is Phase.DECODE and life.prompt_end is None
    life.decoded()
    life.decoded()
    assert life.steps_since == 2
    life.compressed()  # a decode recompression
    assert life.phase is Phase.DECODE and life.steps_since == 0


def test_a_speculative_forward_defers_its_recompression_check_to_the_next_bind():
    life = Lifecycle()
    life.prompt_complete(100)
    life.compressed()
    life.decoded(drafts=True)  # verified drafts: which stay is known only at the next bind
    assert life.check_deferred and life.steps_since == 1
    assert life.deferred_check() and not life.check_deferred and not life.deferred_check()
    life.decoded()
    assert not life.deferred_check() and life.steps_since == 2


def test_query_window_rolls_back_rejected_drafts_without_losing_confirmed_queries():
    """Window of 2: a step verifies token 10 and drafts 11-13 (held beyond the window), the sampler
    keeps 10 and 11: the confirmed window is [10, 11], never shortened by the rejected 12-13."""
    window = QueryWindow(2)
    window.push(torch.zeros(10, 1, 1), 0)
    window.push(torch.ones(4, 1, 1), 10, drafts=3)
    assert window.positions.tolist() == [12, 13]  # what a policy would read before the rollback
    window.truncate(12)
    assert window.positions.tolist() == [10, 11] and window.queries.flatten().tolist() == [1.0, 1.0]
    window.push(torch.full((1, 1, 1), 2.0), 12)  # the next step: position 12 again
    assert window.positions.tolist() == [11, 12] and window.queries.flatten().tolist() == [1.0, 2.0]
    window.push(torch.full((2, 1, 1), 3.0), 11)  # a push drops what it recomputes
    assert window.positions.tolist() == [11, 12] and window.queries.flatten().tolist() == [3.0, 3.0]
    window.truncate(12)
    assert window.positions.tolist() == [11] and window.end == 12
    window.truncate(5)  # past everything held
    assert window.queries is None and window.positions is None and window.end == 5


class _ListWindow:
    """The window's contract stated plainly: a list of (position, query) rows."""

    def __init__(self, size: int, limit: int | None):
        self.size, self.limit, self.rows, self.end = size, limit, [], 0

    def truncate(self, end: int) -> None:
        self.rows = [r for r in self.rows if r[0] < end]
        self.end = min(self.end, end)

    def push(self, queries: torch.Tensor, start: int, drafts: int) -> None:
        self.truncate(start)
        n = queries.shape[0] if self.limit is None else min(queries.shape[0], self.limit - start)
        if n <= 0:
            return
        if start != self.end:
            self.rows = []
        self.rows = (self.rows + [(start + i, queries[i]) for i in range(n)])[-(self.size + drafts) :]
        self.end = start + n


@pytest.mark.parametrize("size,limit", [(1, None), (4, None), (16, None), (4, 40)])
def test_query_window_buffer_holds_what_a_plain_list_holds(size, limit):
    """Random prefill chunks, decode steps, speculative drafts and rollbacks, and gaps: the
    preallocated buffer (rows moved to its front when full) reads like the plain list, and a
    push never aliases the caller's tensor."""
    rng = torch.Generator().manual_seed(size)
    window, reference = QueryWindow(size, limit), _ListWindow(size, limit)
    for _ in range(300):
        action = int(torch.randint(0, 10, (1,), generator=rng))
        if action == 0:
            end = max(0, window.end - int(torch.randint(0, 4, (1,), generator=rng)))
            window.truncate(end)
            reference.truncate(end)
        else:
            n = int(torch.randint(1, 40, (1,), generator=rng)) if action == 1 else 1 + (action == 2) * 3
            drafts = min(n - 1, 3) if action == 2 else 0
            start = window.end + (5 if action == 3 else 0)  # a gap: starts over
            queries = torch.randn(n, 2, 3, generator=rng)
            window.push(queries, start, drafts)
            reference.push(queries.clone(), start, drafts)
            queries.zero_()
        assert window.end == reference.end
        want = reference.rows[-size:]
        if not want:
            assert window.queries is None and window.positions is None
        else:
            assert window.positions.tolist() == [p for p, _ in want]
            torch.testing.assert_close(window.queries, torch.stack([q for _, q in want]))


def test_streamed_chunks_stay_in_prefill():
    life = Lifecycle()
    life.compressed()  # prefill=stream: a chunk compressed before the prompt is complete
    assert life.phase is Phase.PREFILL and life.prompt_end is None


def test_a_postponed_compaction_waits_and_its_point_moves_with_the_tokens():
    life = Lifecycle()
    life.prompt_complete(100)
    life.await_spares(7)
    assert life.phase is Phase.AWAITING_SPARES and life.spares_needed == 7 and life.compression_pending
    life.prompt_complete(101)  # a token decoded meanwhile, over the uncompressed cache
    assert life.phase is Phase.AWAITING_SPARES and life.prompt_end == 101
    life.compressed()
    assert life.phase is Phase.DECODE and life.spares_needed == 0 and life.prompt_end is None


def test_a_compression_decided_off_the_step_decodes_meanwhile_then_switches():
    life = Lifecycle()
    life.prompt_complete(100)
    life.launched()  # the prompt end, decided on the side thread
    assert life.phase is Phase.COMPRESSING and not life.compression_pending
    assert [life.waited(), life.waited()] == [1, 2]  # two steps bound while it was decided
    life.compressed()
    assert life.phase is Phase.DECODE and life.prompt_end is None and life.steps_since == 0
    life.decoded()
    life.launched()  # a due recompression
    assert life.phase is Phase.COMPRESSING and life.steps_waited == 0
    life.await_spares(4)  # copy-on-compress: the switch found too few spares, the decision kept
    assert life.phase is Phase.AWAITING_SPARES
    life.compressed()
    assert life.phase is Phase.DECODE


@pytest.mark.parametrize(("setup", "transition"), [
    ([], lambda life: life.launched()),  # nothing to decide in prefill (a stream chunk is decided in the step)
    ([], lambda life: life.waited()),
    (["prompt", "compress"], lambda life: life.waited()),  # nothing is being decided
    ([], lambda life: life.decoded()),  # no decode before the prompt is compressed
    ([], lambda life: life.await_spares(3)),  # nothing to wait for in prefill
    (["prompt", "compress"], lambda life: life.prompt_complete(5)),  # a decoding prompt is done
    (["prompt", "compress"], lambda life: life.await_spares(3)),
])
def test_illegal_transitions_raise(setup, transition):
    life = Lifecycle()
    for step in setup:
        life.prompt_complete(10) if step == "prompt" else life.compressed()
    before = (life.phase, life.prompt_end, life.steps_since)
    with pytest.raises(IllegalTransition):
        transition(life)
    assert (life.phase, life.prompt_end, life.steps_since) == before


@pytest.mark.parametrize("name", ["snapkv", "tova", "h2o", "expected_attention"])
def test_window_queries_are_captured_only_while_some_compression_can_read_them(name):
    """Until the first compression every policy's window fills; after it only a policy that
    recompresses during decode reads queries again (the others' capture would be wasted work
    in every layer of every decode step)."""
    from vllm_kvcomp.engine.pages import PageGeometry, RequestPages
    from vllm_kvcomp.engine.state import CompressedRequest
    from vllm_kvcomp.spec import CompressionSpec

    spec = CompressionSpec.from_mapping({"policy": name, "ratio": 0.25})
    policy = spec.build_policy()
    pages = RequestPages(PageGeometry(1, 2, 16, torch.zeros(1, dtype=torch.long)))
    state = CompressedRequest(spec=spec, policy=policy, pages=pages)
    assert state.reads_queries
    pages.kept_positions = [[torch.arange(4), torch.arange(4)]]  # what a compaction leaves
    assert state.reads_queries == policy.RECOMPRESSES
    context = CompressionSpec.from_mapping({"policy": name, "ratio": 0.25, "scope": "context"})
    assert not CompressedRequest(spec=context, policy=context.build_policy(), pages=pages).reads_queries


@pytest.mark.parametrize("name", ["sagekv", "entropy"])
def test_a_window_that_only_slides_captures_no_queries(name):
    """Once every layer of sagekv or entropy is pinned its recompressions slide the recent window
    by positions alone (Policy.reads_cache is False): no query is captured for them."""
    from vllm_kvcomp.engine.pages import PageGeometry, RequestPages
    from vllm_kvcomp.engine.state import CompressedRequest
    from vllm_kvcomp.policies.base import RequestState, SlotMemory
    from vllm_kvcomp.policies.entropy import EntropyMemory
    from vllm_kvcomp.policies.sagekv import SageKVMemory
    from vllm_kvcomp.spec import CompressionSpec

    spec = CompressionSpec.from_mapping({"policy": name, "ratio": 0.25})
    pages = RequestPages(PageGeometry(2, 2, 16, torch.zeros(2, dtype=torch.long)))
    pages.kept_positions = [[torch.arange(4), torch.arange(4)]] * 2
    state = CompressedRequest(spec=spec, policy=spec.build_policy(), pages=pages, policy_state=RequestState(budget=100))
    memory = SageKVMemory if name == "sagekv" else EntropyMemory
    state.policy_state.layer(0, memory)
    assert state.reads_queries  # a layer not pinned yet: the next decision scores it
    for layer in range(2):
        entry = state.policy_state.layer(layer, memory)
        entry.pinned = SlotMemory(torch.arange(4).expand(2, 4), torch.ones(2, 4))
        if name == "entropy":
            entry.budget = 100
    assert not state.reads_queries and not state.captures(500, drafts=0)


@pytest.mark.parametrize("name,window", [("tova", 1), ("h2o", 8)])
def test_decode_captures_only_the_steps_a_recompression_can_read(name, window):
    """After a compression a recompressing policy's window is read at its next recompression only,
    so a step is captured only when that may come within ``size`` steps: the policy's own due
    check asked ``size - 1`` steps ahead. Every step the recompression reads is captured (its
    window equals an always-captured one); steps further away are not."""
    from vllm_kvcomp.engine.pages import PageGeometry, RequestPages
    from vllm_kvcomp.engine.state import CompressedRequest
    from vllm_kvcomp.policies.base import RequestState
    from vllm_kvcomp.spec import CompressionSpec

    spec = CompressionSpec.from_mapping({"policy": name, "ratio": 0.25, "interval": 4,
                                         **({"window": window} if name == "h2o" else {})})
    policy = spec.build_policy()
    size = policy.queries_needed()
    pages = RequestPages(PageGeometry(1, 2, 16, torch.zeros(1, dtype=torch.long)))
    pages.kept_positions = [[torch.arange(4), torch.arange(4)]]
    state = CompressedRequest(spec=spec, policy=policy, pages=pages, window=QueryWindow(size),
                              policy_state=RequestState(budget=100, page_quantum=(16, 0)))
    state.lifecycle.prompt_complete(400)
    state.lifecycle.compressed()
    assert state.captures(401, drafts=0)  # the longest head is not known yet
    captured, due = [], []
    for step in range(40):  # a decode step ends at 401 + step tokens, heads at 100 + step + 1
        end, live = 401 + step, 101 + step
        if step:
            captured.append(state.captures(end, drafts=0))
            assert state.captures(end, drafts=1)  # speculative steps: always
        state.lifecycle.decoded()
        state.live = (end, live)
        due.append(policy.due(state.policy_state, live, state.lifecycle.steps_since))
    first = due.index(True)  # the first recompression: a page over the budget, after `interval` steps
    assert first == 15
    reads = set(range(first - size + 1, first + 1))  # the steps its window holds
    assert all(captured[s - 1] for s in reads)
    assert not any(captured[s - 1] for s in range(1, first - size + 1))
