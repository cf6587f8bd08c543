"""Host reads on the decode hot path (issue #16 item 3, the CPU variant of the sync count).

On a GPU every ``.item()``/``.tolist()``/``int(t)``/``bool(t)`` of a device tensor is a
device->host copy and a synchronisation. This test counts those calls made by vllm-kvcomp's own
code inside the attention hook of every layer, with compressed rows in the batch (uniform,
per-head adaptive, per-layer and compensated budgets), and asserts that the layers read nothing
back: what a step needs (which rows are ours, their page tables, lengths and compensation
tokens) is planned once per step at its first compressed layer, and a bounded number of reads
there is all a step costs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import vllm_kvcomp
from tests.engine.conftest import generate, params, prompt_ids
from vllm_kvcomp.engine.backends.common import KVCompAttentionMixin
from vllm_kvcomp.engine.cache import SequenceCompensation
from vllm_kvcomp.engine.plugin import active_worker

pytestmark = pytest.mark.engine

PACKAGE = str(Path(vllm_kvcomp.__file__).parent)
READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")
#: reads a step may make at its first layer: the rows of tracked requests (slot of each row's
#: first token, row bounds), the trimmed rows' longest length for the parent kernel, the
#: compensation plan of all layers (which sequences have a token, their page counts), and the
#: sequences' lengths per layer as planned on the host (layers with equal lengths share one
#: kernel schedule), and the CPU cache's query rows per sequence (which decode rows its C kernel takes)
FIRST_LAYER_BOUND = 7


class HostReads:
    """Counts tensor reads by vllm_kvcomp code in each attention-hook call (one call = one layer
    of one step): ``calls`` holds [layer index in the worker, reads, batch had compressed rows]."""

    def __init__(self):
        self.calls: list[list] = []
        self.inside = False

    def count(self) -> None:
        if self.inside and sys._getframe(2).f_code.co_filename.startswith(PACKAGE):
            self.calls[-1][1] += 1

    def install(self, monkeypatch) -> None:
        for name in READS:
            original = getattr(torch.Tensor, name)

            def wrapper(tensor, *args, _original=original, **kwargs):
                self.count()
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, wrapper)
        forward = KVCompAttentionMixin.forward

        def counted_forward(impl, layer, *args, **kwargs):
            worker = active_worker()
            index = worker.layer_index.get(layer.layer_name) if worker is not None and worker.step else None
            if index is None:
                return forward(impl, layer, *args, **kwargs)
            self.calls.append([index, 0, False])
            self.inside = True
            try:
                return forward(impl, layer, *args, **kwargs)
            finally:
                self.inside = False
                self.calls[-1][2] = worker._batch is not None and len(worker._batch.requests) > 0

        monkeypatch.setattr(KVCompAttentionMixin, "forward", counted_forward)


@pytest.fixture
def host_reads(monkeypatch) -> HostReads:
    reads = HostReads()
    reads.install(monkeypatch)
    return reads


def test_counter_counts_package_reads_only(host_reads):
    """Reads by package code count, reads by other code (this test) do not: a zero can fail."""
    host_reads.calls.append([1, 0, True])
    host_reads.inside = True
    t = torch.arange(3)
    int(t[0]), t.tolist(), t.max().item(), bool(t.any())
    assert host_reads.calls[-1][1] == 0
    SequenceCompensation.plan(torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), torch.tensor([[0.0, 3.0]]), [1, 1],
                              torch.tensor([[5, 9]]), 4, "cpu")  # two .tolist() on the host plan
    host_reads.inside = False
    assert host_reads.calls[-1][1] == 2


def test_no_host_reads_per_layer_in_decode(engine, host_reads):
    specs = [dict(policy="snapkv", ratio=0.25), dict(policy="snapkv", ratio=0.25, heads="adaptive"),
             dict(policy="entropy", ratio=0.3), dict(policy="razor", ratio=0.25, buffer=32),
             dict(policy="lagkv", ratio=0.25, lag=32)]
    prompts = [prompt_ids(300 + 37 * i, seed=90 + i) for i in range(len(specs))]
    outs = generate(engine, prompts, [params(max_tokens=12, **s) for s in specs])
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    ours = [(layer, n) for layer, n, compressed in host_reads.calls if compressed]
    later = [n for layer, n in ours if layer > 0]
    first = [n for layer, n in ours if layer == 0]
    assert len(first) >= 8, "compressed rows decoded in too few steps for the test to mean anything"
    assert len(later) == len(first) * (active_worker().num_layers - 1)
    assert sum(later) == 0, f"host reads in layers after the first: {later}"
    assert 0 < max(first) <= FIRST_LAYER_BOUND, f"host reads at the first layer of each step: {first}"
