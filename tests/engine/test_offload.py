"""Compressions decided off the step (vllm_kvcomp/engine/offload.py), without vLLM: the side
thread, the kept set at a later length, the side CUDA stream (GPU machines only)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from vllm_kvcomp.engine.offload import NICENESS, CompressionOffload, Decision
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
        decision = offload.launch(decide).result(timeout=60)
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
            future.result(timeout=60)
    finally:
        offload.close()


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
