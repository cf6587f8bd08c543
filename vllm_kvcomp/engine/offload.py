"""Compression off the step's critical path: decisions made on a side thread (and, on a GPU, a
side CUDA stream) while the request keeps decoding over the pages it has.

A decision only reads: the request's cells before its decision point (no step writes them: a
step appends after them, and nothing else compacts the request while it is pending), frozen
copies of its query window and observed attention, and a copy of its policy state. The switch
(:meth:`~vllm_kvcomp.engine.worker.KVCompWorker.bind`) packs the kept cells plus every token
since the decision at a step boundary, on the step's own thread and stream.

``compression_lag`` (the connector's ``kv_connector_extra_config``) says when a request switches:
``"auto"`` (the default on GPUs) at the first step that binds after its decision is made; an integer ``k > 0``
at exactly the ``k``-th step after the launch, waiting for the decision if it is not made yet
(reproducible: the same steps give the same answer, as the oracle's ``lag``); ``0`` (the default
on vLLM's CPU backend, see :func:`parse_lag`) decides and packs inside the step. Tensor-parallel engines decide inside the step (a policy's
collectives over the ranks cannot run on a side thread).

On the host the side thread would share the step's cores (and stretch every step it overlaps),
so there a decision runs in :class:`Slices`: only while a step waits for it, for a share of a
step at a time, stopping at its next layer read after that.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_kvcomp.engine.pages import Move, RequestPages
from vllm_kvcomp.policies.base import Compensation, RequestState

AUTO = "auto"
#: the side thread's scheduling priority on the host: about a tenth of a busy core next to the
#: step's threads (measured, bench stall at 2K: nice 0 made steps 2-7x longer while a decision ran,
#: 5 1.6-1.8x, 10 1.3-1.5x, each decision then packed after more tokens)
NICENESS = 10
#: on the host, the most of a step a decision's slice takes: this share of the median step (the
#: steps' own time, slices left out), so no step with compression work is 1.5x the median
SLICE_SHARE = 0.4
#: median of the last this many steps
STEPS_TIMED = 16
#: a slice before any step was timed
FIRST_SLICE_S = 0.005
#: a decision no step has given a slice for this long runs on freely (an idle engine stalls
#: nothing; longer than a 2K-token prefill step on the CPU)
IDLE_S = 5.0


def parse_lag(value: object, platform: str | None = None) -> int | None:
    """``compression_lag`` from the connector's extra config: None for ``"auto"``, else steps >= 0.
    Unset: auto on a GPU; 0 on the host (``platform`` "cpu"), where a side thread takes its cycles
    from the step's own cores: there, off the step trades stalls for savings that come later."""
    if value is None:
        return 0 if platform == "cpu" else None
    if value == AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"kv_connector_extra_config.compression_lag must be {AUTO!r} or an integer >= 0 "
                         f"(steps; 0 compresses inside the step), got {value!r}")
    return value


def _yielding_thread() -> None:
    """On the host, the side thread gives way to the step's: one OpenMP thread of its own (the
    step's team keeps every core it was given; libgomp's setting is per thread) and the lowest
    scheduling priority (Linux: per thread), so a decision takes the cycles steps leave idle."""
    lib = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if lib.exists():
        # torch sets a new thread's OpenMP threads to the process's torch.set_num_threads at its
        # first parallel call (vLLM's CPU worker sets it): that first, then this thread's own
        torch.get_num_threads()
        ctypes.CDLL(str(lib)).omp_set_num_threads(1)
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)


@dataclass
class Decision:
    """What a compression decided at ``end`` tokens, nothing written yet."""

    end: int
    decode: bool  # a decode recompression (else the prompt end, or a prefill chunk)
    kept: list[list[torch.Tensor]]  # [layer][head]: kept indices of the head's sequence at ``end`` (host)
    before: torch.Tensor  # [L, H] each head's length at ``end``
    compensations: list[Compensation | None]  # per layer
    policy_state: RequestState  # the policy's state after deciding
    seconds: float = 0.0  # time it took to decide
    ready: object | None = None  # a CUDA event the step's stream waits on before reading it
    #: planned off the step: (the spares it writes, the moves, the pages after them)
    packing: tuple[tuple[int, ...], Move | None, RequestPages | None] | None = None

    @property
    def compacts(self) -> bool:
        """Whether packing it moves anything: some head keeps fewer cells, or it made a token."""
        return bool((self.counts() < self.before).any()) or any(c is not None for c in self.compensations)

    def counts(self) -> torch.Tensor:
        """[L, H] cells each head keeps at the decision point."""
        return torch.tensor([[len(idx) for idx in layer] for layer in self.kept])


class Slices:
    """On the host, the side thread's decisions run only while a step waits for them: the step's
    thread calls :meth:`run` once a step, which lets the running decision work for a slice and
    returns once it stops at its next :meth:`checkpoint` (each layer it reads) after the slice,
    or ends. :meth:`unlimited` opens the gate (a step that must have a result waits for it anyway);
    with no step for :data:`IDLE_S` a decision runs freely. A decision starts only in a slice, so
    one ending in a slice leaves the next for the next step."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._until = 0.0  # the current slice ends then
        self._stepped = time.perf_counter()  # the last step that gave a slice
        self._open = 0  # unlimited() callers
        self._running = False  # a decision is under way (between start and end)
        self._held = False  # ... and waits at a checkpoint

    def _granted(self) -> bool:
        now = time.perf_counter()
        return self._open > 0 or now < self._until or now - self._stepped > IDLE_S

    def checkpoint(self) -> None:
        """The side thread, between pieces of a decision: wait for a slice unless in one."""
        with self._cond:
            while not self._granted():
                self._held = True
                self._cond.notify_all()
                self._cond.wait(timeout=IDLE_S)
            self._held = False

    @contextlib.contextmanager
    def decision(self):
        """The side thread, around one decision: it starts in a slice; its end wakes the step."""
        with self._cond:
            self._running = True
        try:
            self.checkpoint()
            yield
        finally:
            with self._cond:
                self._running = self._held = False
                self._until = 0.0  # the next decision starts in the next step's slice
                self._cond.notify_all()

    def run(self, seconds: float) -> float:
        """The step's thread: let the decision under way work for ``seconds`` (to its next
        checkpoint after them); the seconds waited (0 when none is under way)."""
        start = time.perf_counter()
        with self._cond:
            self._stepped = start
            if not self._running:
                return 0.0
            self._until = start + seconds
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._running or (self._held and time.perf_counter() >= self._until))
            self._until = 0.0
            self._stepped = time.perf_counter()
        return self._stepped - start

    def release(self) -> None:
        """Let every decision run freely (for good when the offload closes; :meth:`unlimited` takes it back)."""
        with self._cond:
            self._open += 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def unlimited(self):
        """The step's thread waits for a result: let decisions run freely meanwhile."""
        self.release()
        try:
            yield
        finally:
            with self._cond:
                self._open -= 1


class StepClock:
    """The length of the steps that bind, less the slices they gave: a slice's length."""

    def __init__(self) -> None:
        self._last: float | None = None
        self._sliced = 0.0
        self._steps: list[float] = []

    def start(self) -> None:
        """A step binds: the one before it ends."""
        now = time.perf_counter()
        if self._last is not None:
            self._steps = [*self._steps[-(STEPS_TIMED - 1):], now - self._last - self._sliced]
        self._last, self._sliced = now, 0.0

    def sliced(self, seconds: float) -> None:
        """The step gave a decision ``seconds``."""
        self._sliced += seconds

    def slice(self) -> float:
        """:data:`SLICE_SHARE` of the median step."""
        return SLICE_SHARE * statistics.median_high(self._steps) if self._steps else FIRST_SLICE_S


class CompressionOffload:
    """One side thread making decisions in launch order: on a GPU on a side CUDA stream, on the
    host in :class:`Slices` that :meth:`step` gives once a step."""

    def __init__(self, device: torch.device):
        self.device = device
        self._executor: ThreadPoolExecutor | None = None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.slices = Slices() if self._stream is None else None
        self._clock = StepClock()

    def launch(self, decide: Callable[[], Decision]) -> Future:
        """Run ``decide`` off the step; on a GPU its stream first waits for what the step's
        stream has written so far (the cells it reads), never the host."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcomp-compress",
                                                initializer=None if self._stream is not None else _yielding_thread)
        if self._stream is None:
            return self._executor.submit(self._sliced, decide)
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(self.device))
        return self._executor.submit(self._on_stream, decide, written)

    def _sliced(self, decide: Callable[[], Decision]) -> Decision:
        with self.slices.decision():
            return self._timed(decide)

    def checkpoint(self) -> None:
        """Called by a decision off the step between pieces of work (each layer it reads): on the
        host it waits there for the next slice; a no-op on a GPU."""
        if self.slices is not None:
            self.slices.checkpoint()

    def step(self) -> None:
        """Once a step, as it binds: on the host, the decision under way gets its slice."""
        if self.slices is not None:
            self._clock.start()
            self._clock.sliced(self.slices.run(self._clock.slice()))

    def result(self, pending: Future) -> Decision:
        """The decision of ``pending``, waited for (decisions run freely meanwhile)."""
        if self.slices is None or pending.done():
            return pending.result()
        with self.slices.unlimited():
            return pending.result()

    @staticmethod
    def _timed(decide: Callable[[], Decision]) -> Decision:
        started = time.perf_counter()
        with torch.inference_mode():  # as the step's thread runs (a mode is per thread)
            decision = decide()
        decision.seconds = time.perf_counter() - started
        return decision

    def _on_stream(self, decide: Callable[[], Decision], written: torch.cuda.Event) -> Decision:
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(written)
            decision = self._timed(decide)
            decision.ready = torch.cuda.Event()
            decision.ready.record(self._stream)
        return decision

    @staticmethod
    def adopt(decision: Decision, device: torch.device) -> None:
        """The step's stream waits (on the device) for the decision's work before reading it, and
        the allocator keeps what the decision made for it until the step's stream is done with it."""
        if decision.ready is None:
            return
        stream = torch.cuda.current_stream(device)
        stream.wait_event(decision.ready)
        for comp in decision.compensations:
            for tensor in () if comp is None else (comp.keys, comp.values, comp.counts):
                tensor.record_stream(stream)

    def close(self, wait: bool = False) -> None:
        """Cancel the decisions not started; ``wait`` for the one running (which runs freely)."""
        if self._executor is not None:
            if self.slices is not None:
                self.slices.release()
            self._executor.shutdown(wait=wait, cancel_futures=True)
            self._executor = None
