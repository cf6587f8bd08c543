"""One request's compression lifecycle: the states, which half moves it, and the message that does.

The scheduler half (engine-core process, :mod:`~vllm_kvcomp.engine.scheduler`) and the worker
half (:mod:`~vllm_kvcomp.engine.worker`) each keep their side of a tracked request; they talk
only through :class:`~vllm_kvcomp.engine.metadata.StepMetadata` (scheduler -> worker, every step)
and :class:`~vllm_kvcomp.engine.metadata.WorkerReport` (worker -> scheduler, every step's output).
With ``--async-scheduling`` the scheduler plans step t+1 before it reads step t's report, so a
report is acted on one step later; every transition below tolerates that (freed blocks are
handed out in step t+2 at the earliest, spares wait for the report that asks for them)::

    scheduler                                worker (:class:`Phase`)
    ---------                                -----------------------
    on_new_request: TRACKED
      (prefix caching: SHARING, its            PREFILL ──finish_step, prefill=stream and a head
       cache hit capped before the window)       │        over budget: compress this chunk ──▶ PREFILL
    build_meta: rows, block ids, spares ────▶    │ finish_step: the prompt is in the cache
      (SpareState.SENT in the step that           ▼
       completes the prompt)                   PROMPT_END ──bind (next step, before its forward):
                                                 │          select + pack (into the spares) ──▶ DECODE
                                                 │ copy-on-compress with too few spares:
                                                 ▼ report.spares_needed
    on_worker_report: needed = n ◀──────────  AWAITING_SPARES ──bind with n spares: pack ──▶ DECODE
    build_meta: n spares ───────────────────▶    (the compression point moves with the tokens)
    on_worker_report: copied -> install spares
      (SpareState.SETTLED), freeable -> free    DECODE ──finish_step, policy.due: recompress ──▶ DECODE
      leading columns (null block)
                                               DECODE ──finish_step of a forward that verified draft
                                                 │      tokens (speculative decoding): which of them
                                                 │      stay is not known yet ──▶ DECODE, check deferred
                                                 └──bind (next step): the recompression check runs
                                                    over the confirmed tokens only (num_computed)

    any state ──preempted (build_meta: dropped) ──▶ forgotten on both sides; vLLM recomputes the
        prompt and the request starts over at TRACKED / PREFILL (spares released; a decision
        still being made is cancelled or, made, dropped unread: it never wrote to the cache)
    any state ──finished or aborted (request_finished: dropped) ──▶ forgotten; spares released

A worker that cannot compress on this engine (:meth:`KVCompWorker.disable`) sends ``unavailable``
in every report; the scheduler then serves every request uncompressed and says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Phase(Enum):
    """Where a tracked request is, on the worker side."""

    PREFILL = "prefill"  # its prompt is not all in the cache yet
    PROMPT_END = "prompt_end"  # the prompt is in; compressed when the next step binds
    AWAITING_SPARES = "awaiting_spares"  # copy-on-compress postponed until enough spares come
    COMPRESSING = "compressing"  # its compression is being decided off the step; decodes meanwhile
    DECODE = "decode"  # compressed at the end of its prompt (or kept everything); may recompress


class SpareState(Enum):
    """A prefix-sharing request's spares, on the scheduler side (copy-on-compress)."""

    NONE = "none"  # none sent yet (the prompt is not complete)
    SENT = "sent"  # sent with the step that completes the prompt (or asked for again)
    SETTLED = "settled"  # the first compaction happened (in the spares or in place): nothing pending


class IllegalTransition(RuntimeError):
    """An engine bug: a transition from a state that does not lead to it."""


@dataclass
class Lifecycle:
    """The worker side of one request's lifecycle (see the module docstring)."""

    phase: Phase = Phase.PREFILL
    #: the logical length the pending prompt-end compression runs at (PROMPT_END, AWAITING_SPARES)
    prompt_end: int | None = None
    spares_needed: int = 0  # AWAITING_SPARES: wait until this many spares come
    steps_since: int = 0  # DECODE: forwards since the last compression
    #: DECODE: the last forward verified draft tokens; its recompression check waits for bind
    check_deferred: bool = False
    #: COMPRESSING: steps bound since the launch (the switch waits for the decision at ``lag``)
    steps_waited: int = 0
    #: copy-on-compress: column -> spare block the first compaction packed into (the scheduler's
    #: block table says so too once it processed the report; until then this is the truth)
    block_override: dict[int, int] = field(default_factory=dict)

    @property
    def compression_pending(self) -> bool:
        return self.phase in (Phase.PROMPT_END, Phase.AWAITING_SPARES)

    def _expect(self, *phases: Phase) -> None:
        if self.phase not in phases:
            raise IllegalTransition(f"{self.phase.value} -> ? (expected {', '.join(p.value for p in phases)})")

    def prompt_complete(self, end: int) -> None:
        """finish_step: the prompt is in the cache up to ``end`` (again, while the compression waits)."""
        self._expect(Phase.PREFILL, Phase.PROMPT_END, Phase.AWAITING_SPARES)
        if self.phase is Phase.PREFILL:
            self.phase = Phase.PROMPT_END
        self.prompt_end = end

    def launched(self) -> None:
        """Its compression is decided off the step from now on (prompt end or a due recompression)."""
        self._expect(Phase.PROMPT_END, Phase.DECODE)
        self.phase, self.steps_waited = Phase.COMPRESSING, 0

    def waited(self) -> int:
        """bind while COMPRESSING: one more step bound since the launch; how many."""
        self._expect(Phase.COMPRESSING)
        self.steps_waited += 1
        return self.steps_waited

    def await_spares(self, needed: int) -> None:
        """The compaction needs ``needed`` spares and got fewer: postponed, policy state rolled back."""
        self._expect(Phase.PROMPT_END, Phase.AWAITING_SPARES, Phase.COMPRESSING)
        self.phase, self.spares_needed = Phase.AWAITING_SPARES, needed

    def compressed(self) -> None:
        """A compression ran (the prompt-end one, or one decided off the step, moves the request to DECODE)."""
        if self.compression_pending or self.phase is Phase.COMPRESSING:
            self.phase, self.prompt_end, self.spares_needed = Phase.DECODE, None, 0
        self.steps_since = 0

    def decoded(self, drafts: bool = False) -> None:
        """finish_step in DECODE: one more forward since the last compression; with ``drafts``
        (it verified draft tokens) the recompression check waits for the next bind."""
        self._expect(Phase.DECODE)
        self.steps_since += 1
        self.check_deferred = drafts

    def deferred_check(self) -> bool:
        """bind: whether a deferred recompression check is due now (and no longer pending)."""
        due, self.check_deferred = self.check_deferred, False
        return due
