"""A compression that cannot get memory is not fatal (issue #69 item 3).

The allocator is made to refuse one allocation of one compression: every tensor an aten operation
creates inside ``KVCompWorker._compress`` (off the step: its decision on the side thread and its
switch in the step) counts (the cache's own buffers, host planning tensors,
the policy's scores), and the chosen one raises ``torch.OutOfMemoryError`` as a CUDA allocator
does. Whatever the point, the request must be left exactly as it was (the harness reads every
scheduled request's KV back after every step), complete, give every block back, and the engine
must serve on; a first compression that fails serves the request uncompressed and says why, a
later one keeps what the request holds. On the real engine the answer then equals the
uncompressed one (``tests/engine/test_lifecycle.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.engine.test_device_syncs import tensors_in
from tests.engine.test_step_harness import PROMPT, assert_clean, ids, spec_for
from tests.helpers.step_harness import StepHarness
from vllm_kvcomp.engine.worker import KVCompWorker

pytestmark = pytest.mark.vllm

#: scenario -> (spec, harness options, which compression fails: its decode flag and how many of
#: that kind come before it)
SCENARIOS = {
    "prompt end": ({"policy": "snapkv"}, {}, (False, 0)),
    "stream chunk": ({"policy": "lagkv", "prefill": "stream"}, {"max_num_batched_tokens": 128}, (False, 0)),
    "recompression": ({"policy": "h2o"}, {}, (True, 0)),
    "copy-on-compress": ({"policy": "snapkv"}, {"prefix_caching": True}, (False, 0)),
    # decided off the step (engine/offload.py), packed at the 2nd bind after
    "prompt end, off the step": ({"policy": "snapkv"}, {"compression_lag": 2}, (False, 0)),
    "recompression, off the step": ({"policy": "h2o"}, {"compression_lag": 2}, (True, 0)),
    "copy-on-compress, off the step": ({"policy": "snapkv"}, {"prefix_caching": True, "compression_lag": 2},
                                       (False, 0)),
}


class RefusingAllocator(TorchDispatchMode):
    """Counts the tensors aten operations create (outputs sharing no input's storage) and makes
    the ``refuse``-th of them fail as a CUDA allocator does (None: count only)."""

    def __init__(self, refuse: int | None = None):
        super().__init__()
        self.refuse = refuse
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tensors_in([list(args), list(kwargs.values())])
                  if t.device.type != "meta"}
        fresh = [t for t in tensors_in(out) if t.untyped_storage().data_ptr() not in inputs]
        if fresh:
            self.count += 1
            if self.count == self.refuse:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return out


def arm(monkeypatch, target: tuple[bool, int], allocator: RefusingAllocator) -> list[bool]:
    """Runs the target compression (by its decode flag and rank) under ``allocator``; returns
    the decode flag of every compression seen."""
    seen: list[bool] = []
    compress = KVCompWorker._compress

    def watched(self, rid, state, sched, end, decode):
        rank = sum(1 for d in seen if d == decode)
        seen.append(decode)
        if (decode, rank) == target:
            with allocator:
                return compress(self, rid, state, sched, end, decode)
        return compress(self, rid, state, sched, end, decode)

    monkeypatch.setattr(KVCompWorker, "_compress", watched)
    return seen


def arm_off_the_step(monkeypatch, target: tuple[bool, int], allocator: RefusingAllocator) -> list[bool]:
    """As :func:`arm` for a compression decided off the step: its decision (on the side thread)
    and its switch (in the step) under ``allocator``."""
    seen: list[bool] = []
    targeted: list[object] = []
    decide, switch = KVCompWorker.decide, KVCompWorker._switch

    def watched_decide(self, state, block_ids, end, decode, policy_state, pause=None):
        rank = sum(1 for d in seen if d == decode)
        seen.append(decode)
        if (decode, rank) != target:
            return decide(self, state, block_ids, end, decode, policy_state, pause)
        with allocator:  # a dispatch mode is per thread: entered on the side thread
            decision = decide(self, state, block_ids, end, decode, policy_state, pause)
        targeted.append(decision)
        return decision

    def watched_switch(self, rid, state, sched, decision, now, started=None):
        if decision not in targeted:
            return switch(self, rid, state, sched, decision, now, started)
        with allocator:
            return switch(self, rid, state, sched, decision, now, started)

    monkeypatch.setattr(KVCompWorker, "decide", watched_decide)
    monkeypatch.setattr(KVCompWorker, "_switch", watched_switch)
    return seen


def _run(tiny_model_dir, name: str, refuse: int | None, monkeypatch) -> tuple[StepHarness, RefusingAllocator]:
    spec, options, target = SCENARIOS[name]
    allocator = RefusingAllocator(refuse)
    with monkeypatch.context() as patch:
        (arm_off_the_step if options.get("compression_lag") else arm)(patch, target, allocator)
        h = StepHarness(tiny_model_dir, **options)
        policy = spec["policy"]
        if options.get("prefix_caching"):  # a first reader caches the prompt; the second shares it
            h.add("first", ids(PROMPT, 7), None, max_tokens=2)
            h.run_until_idle()
        h.add("r", ids(PROMPT, 7), policy, max_tokens=48, **spec_for(policy, **{k: v for k, v in spec.items()
                                                                                 if k != "policy"}))
        h.run_until_idle()
    return h, allocator


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_refused_allocation_leaves_the_request_as_it_was(tiny_model_dir, monkeypatch, name):
    """Points spread over every allocation of the compression, its first and its last included."""
    _, counted = _run(tiny_model_dir, name, None, monkeypatch)
    total = counted.count
    assert total > 10, f"{name}: the targeted compression allocated {total} tensors"
    points = sorted({1, 2, total // 4, total // 2, 3 * total // 4, total - 1, total})
    for refuse in points:
        h, allocator = _run(tiny_model_dir, name, refuse, monkeypatch)
        assert allocator.count == refuse, f"{name}: the compression stopped before allocation {refuse}"
        assert len(h.outputs["r"]) == 48, f"{name} @ {refuse}: the request did not complete"
        stats = h.results["r"]["kvcomp"]
        assert stats["compression_failures"] == 1, (name, refuse, stats)
        if SCENARIOS[name][2][0]:  # a recompression: the request keeps what it holds
            assert stats["applied"] != "none" and stats["compressions"] >= 1, (name, refuse, stats)
        else:  # the first compression: served uncompressed, saying why
            assert stats["applied"] == "none" and "no memory for the compression" in stats["reason"], stats
        assert_clean(h)  # every block back, no state left on either half
        h.add("next", ids(PROMPT, 8), "snapkv", max_tokens=8, **spec_for("snapkv"))  # the engine serves on
        h.run_until_idle()
        assert h.results["next"]["kvcomp"]["compressions"] >= 1
        assert_clean(h)


def test_errors_other_than_allocation_failures_still_surface(tiny_model_dir, monkeypatch):
    """Only the allocator's refusals are absorbed: another RuntimeError is a bug and propagates."""

    def broken(self, *args, **kwargs):
        raise RuntimeError("index out of range in self")

    monkeypatch.setattr(KVCompWorker, "_plan_compaction", broken)
    h = StepHarness(tiny_model_dir)
    h.add("r", ids(PROMPT, 7), "snapkv", max_tokens=8, **spec_for("snapkv"))
    with pytest.raises(RuntimeError, match="index out of range"):
        h.run_until_idle()
