"""Compressions decided off the step (vllm_kvcomp/engine/offload.py), without vLLM: the side
thread, the kept set at a later length, the side CUDA stream (GPU machines only)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from vllm_kvcomp.engine import offload as offload_module
from vllm_kvcomp.engine.offload import NICENESS, CompressionOffload, Decision, Slices, StepClock
from vllm_kvcomp.policies.base import Compensation, RequestState


def _decision(end: int = 10, kept=None, before=None, compensations=None) -> Decision:
    kept = kept if kept is not None else [[torch.tensor([0, 4, 9])]]
    before = before if before is not None else torch.tensor([[10]])
    return Decision(end, False, kept, before, compensations or [None] * len(kept), RequestState())


def test_a_decision_compacts_when_a_head_keeps_less_or_it_made_a_token():
    kept = [[torch.tensor([0, 4, 9]), torch.arange(6)]]
    decision = _decision(end=10, kept=kept, before=torch.tensor([[10, 6]]))
    assert decision.counts().tolist() == [[3, 6]] and decision.compacts
    whole = _decision(end=10, kept=[[torch.arange(10), torch.arange(6)]], before=torch.tensor([[10, 6]]))
    assert not whole.compacts
    token = Compensation(torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2))
    assert _decision(end=10, kept=whole.kept, before=whole.before, compensations=[token]).compacts


def test_the_side_thread_yields_to_the_steps_threads():
    """One OpenMP thread of its own at nice 10, in inference mode; the step's thread keeps its
    threads and its priority."""
    seen = {}

    def decide() -> Decision:
        seen.update(thread=threading.get_ident(), threads=torch.get_num_threads(),
                    nice=os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                    inference=torch.is_inference_mode_enabled())
        return _decision()

    threads, nice = torch.get_num_threads(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    torch.set_num_threads(2)  # as vLLM's CPU worker does: torch gives every new thread as many at first use
    mine = torch.get_num_threads()  # (2, unless an engine earlier in this process bound this thread)
    offload = CompressionOffload(torch.device("cpu"))
    try:
        decision = offload.result(offload.launch(decide))
    finally:
        offload.close()
    assert seen["thread"] != threading.get_ident() and decision.seconds > 0
    assert (seen["threads"], seen["nice"], seen["inference"]) == (1, max(nice, NICENESS), True)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == nice and torch.get_num_threads() == mine
    torch.set_num_threads(threads)


def test_a_failed_decision_surfaces_where_it_is_packed():
    offload = CompressionOffload(torch.device("cpu"))

    def decide() -> Decision:
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    try:
        future = offload.launch(decide)
        with pytest.raises(torch.OutOfMemoryError):
            offload.result(future)
    finally:
        offload.close()


class Pieces:
    """A decision of ``n`` pieces on the side thread, each recorded as it starts (a layer read)."""

    def __init__(self, offload: CompressionOffload, n: int, seconds: float = 0.0):
        self.done: list[int] = []
        self.offload, self.n, self.seconds = offload, n, seconds

    def __call__(self) -> Decision:
        for i in range(self.n):
            self.offload.checkpoint()
            self.done.append(i)
            time.sleep(self.seconds)
        return _decision()


def test_on_the_host_a_decision_runs_only_in_the_slices_steps_give_it():
    offload = CompressionOffload(torch.device("cpu"))
    first, second = Pieces(offload, 6, seconds=0.01), Pieces(offload, 2)
    try:
        futures = [offload.launch(first), offload.launch(second)]
        time.sleep(0.2)
        assert first.done == []  # no step yet: it waits for a slice
        slices = []
        while not futures[0].done():
            before = len(first.done)
            waited = offload.slices.run(0.015)
            slices.append(len(first.done) - before)
            time.sleep(0.05)  # the step's own work: the decision stays where the slice left it
            assert len(first.done) == before + slices[-1]
        # a slice of 15 ms runs pieces of 10 ms to the first checkpoint after it: 2 pieces each
        # (1 where the side thread woke late), never more
        assert sum(slices) == 6 and all(1 <= n <= 2 for n in slices) and 0 < waited < 1
        assert second.done == []  # it starts in the next step's slice, not in the one that ended the first
        offload.slices.run(0.015)
        assert offload.result(futures[1]) is not None and second.done == [0, 1]
    finally:
        offload.close()


def test_a_step_waiting_for_a_decision_lets_it_run_freely():
    offload = CompressionOffload(torch.device("cpu"))
    pieces = Pieces(offload, 40)
    try:
        decision = offload.result(offload.launch(pieces))
    finally:
        offload.close()
    assert pieces.done == list(range(40)) and decision.end == 10


def test_with_no_step_for_a_while_a_decision_runs_on(monkeypatch):
    monkeypatch.setattr(offload_module, "IDLE_S", 0.1)
    offload = CompressionOffload(torch.device("cpu"))
    pieces = Pieces(offload, 5)
    try:
        future = offload.launch(pieces)
        time.sleep(0.02)
        assert pieces.done == []
        assert future.result(timeout=10) is not None and pieces.done == list(range(5))
    finally:
        offload.close()


def test_a_closed_offload_lets_the_decision_under_way_finish():
    offload = CompressionOffload(torch.device("cpu"))
    pieces = Pieces(offload, 3)
    future = offload.launch(pieces)
    deadline = time.monotonic() + 5
    while not future.running() and time.monotonic() < deadline:  # under way: not just queued
        time.sleep(0.001)
    offload.close(wait=True)
    assert future.result(timeout=1) is not None and pieces.done == [0, 1, 2]


def test_the_slice_is_a_share_of_the_median_step_less_the_slices(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(offload_module.time, "perf_counter", lambda: now[0])
    clock = StepClock()
    assert clock.slice() == offload_module.FIRST_SLICE_S
    for step, sliced in [(0.030, 0.0), (0.040, 0.012), (0.020, 0.0), (0.500, 0.0)]:
        clock.start()
        clock.sliced(sliced)
        now[0] += step
    clock.start()
    # steps 30, 40 - 12 = 28, 20, 500 ms: the median (upper of the middle two) is 30 ms
    assert clock.slice() == pytest.approx(offload_module.SLICE_SHARE * 0.030)
    assert Slices().run(1.0) == 0.0  # nothing under way: the step does not wait


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_decision_runs_on_a_side_stream_after_what_the_step_wrote():
    """The side stream waits for the step's writes (an event, not the host); the step's stream
    waits for the decision's work before it reads what the decision made."""
    device = torch.device("cuda")
    cells = torch.zeros(1 << 22, device=device)
    torch.cuda._sleep(50_000_000)  # the step's stream is busy ...
    cells.fill_(3.0)  # ... then writes the cells the decision reads
    offload = CompressionOffload(device)

    def decide() -> Decision:
        assert torch.cuda.current_stream(device) != torch.cuda.default_stream(device)
        total = cells.sum()  # on the side stream, after the event
        comp = Compensation(total.expand(1, 1).clone(), total.expand(1, 1).clone(), total.expand(1).clone())
        return _decision(compensations=[comp])

    try:
        decision = offload.launch(decide).result(timeout=60)
    finally:
        offload.close()
    CompressionOffload.adopt(decision, device)
    assert decision.compensations[0].counts.item() == 3.0 * cells.numel()
