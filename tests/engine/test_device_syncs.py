"""No host stalls in a step (issue #68 items 1 and 4): what a GPU would sync on or copy, and
the collectives tensor parallelism makes, counted on CPU.

On a GPU, reading a device tensor on the host (``.item()``, ``.tolist()``, ``bool(t)``,
``nonzero``, boolean-mask indexing, ...) waits for every queued kernel, and a host tensor that
meets a device tensor is a blocking copy from pageable memory. The step harness runs the kvcomp
worker over :class:`CudaPagedCache` on CPU tensors, with the KV buffer, vLLM's queries and
outputs, and whatever :class:`HostStaging` sends marked as device tensors (:class:`OnDevice`, a
tensor subclass every result of an operation on them inherits). A ``TorchFunctionMode`` then
records, for calls made by ``vllm_kvcomp.engine`` outside a compression (compressions may sync:
issue #69 takes them off the step): every host read of a device tensor, and every operation
mixing a device tensor with a host tensor (a copy the staging did not make). The kernels are
stubbed and check that every tensor they get is on the device.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import vllm_kvcomp
from tests.engine.test_step_harness import ids, spec_for
from tests.helpers.step_harness import StepHarness
from vllm_kvcomp import kernels
from vllm_kvcomp.engine import staging
from vllm_kvcomp.engine.cache import AttentionVariant
from vllm_kvcomp.engine.worker import KVCompWorker
from vllm_kvcomp.policies.base import Ranks
from vllm_kvcomp.policies.registry import POLICY_NAMES

pytestmark = pytest.mark.vllm

ENGINE = str(Path(vllm_kvcomp.__file__).parent / "engine")
TORCH = str(Path(torch.__file__).parent)
#: operations whose result a GPU must send back to the host (or whose output size it must read first)
READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero",
         "masked_select", "unique", "bincount", "equal", "allclose"}


class OnDevice(torch.Tensor):
    """A tensor that would live on the GPU."""

    def __deepcopy__(self, memo):  # a recompression keeps a copy of the policy's state
        return self.as_subclass(torch.Tensor).clone().as_subclass(OnDevice)


def on_device(t):
    return t.as_subclass(OnDevice) if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) else t


def tensors_in(value):
    """Every tensor in ``value`` (nested lists and tuples, a slice's bounds)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, slice):
        yield from tensors_in([value.start, value.stop, value.step])


class Stalls(TorchFunctionMode):
    """Records host reads of device tensors and host tensors meeting device tensors, made by
    engine code outside a compression."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []
        self.checked = 0  # device operations by engine code seen (the test means something)
        self.compressing = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        caller = self._caller()
        if caller is not None and not self.compressing:
            tensors = list(tensors_in(list(args) + list(kwargs.values())))
            device = [t for t in tensors if isinstance(t, OnDevice)]
            if device:
                self.checked += 1
                name = getattr(func, "__name__", str(func))
                where = f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno} {name}"
                host = [t for t in tensors if not isinstance(t, OnDevice) and t.dim() > 0]
                boolean_index = name in ("__getitem__", "__setitem__", "index_put_") and any(
                    t.dtype == torch.bool for t in tensors[1:])
                to_host = name == "to" and any(a == "cpu" or a == torch.device("cpu") for a in args[1:])
                if name in READS or boolean_index or to_host:
                    self.found.append(f"read back: {where}")
                elif host:
                    self.found.append(f"host tensor {tuple(host[0].shape)} into a device op: {where}")
                elif name == "repeat_interleave" and "output_size" not in kwargs and any(
                        isinstance(a, torch.Tensor) for a in args[1:2]):
                    self.found.append(f"read back (output size): {where}")
        return func(*args, **kwargs)

    @staticmethod
    def _caller():
        """The first frame outside torch and this module, if it is engine code."""
        frame = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename.startswith(TORCH)
                                     or frame.f_code.co_filename == __file__):
            frame = frame.f_back
        return frame if frame is not None and frame.f_code.co_filename.startswith(ENGINE) else None


@pytest.fixture
def stalls(monkeypatch):
    """Device marking (staging, kernels stubbed) and the recorder, active inside the worker's hooks."""
    mode = Stalls()
    send = staging.HostStaging.send
    monkeypatch.setattr(staging.HostStaging, "send", lambda self, *t: tuple(on_device(x) for x in send(self, *t)))

    def stub(name):
        def kernel(q, *args, **kwargs):
            for t in tensors_in(list(args) + list(kwargs.values())):
                if t.dim() > 0 and not isinstance(t, OnDevice):
                    mode.found.append(f"{name} got a host tensor {tuple(t.shape)}")
            out = torch.zeros_like(q)
            return out, torch.zeros(out.shape[:2], dtype=torch.float32).as_subclass(OnDevice)
        return kernel

    monkeypatch.setattr(kernels, "decode_attention", stub("decode_attention"))
    monkeypatch.setattr(kernels, "prefill_attention", stub("prefill_attention"))

    def guarded(method):
        def call(self, *args, **kwargs):
            with mode:
                return method(self, *(on_device(a) for a in args), **kwargs)
        return call

    def compressing(method):
        def call(self, *args, **kwargs):
            mode.compressing += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                mode.compressing -= 1
        return call

    for name in ("bind", "finish_step"):
        monkeypatch.setattr(KVCompWorker, name, guarded(getattr(KVCompWorker, name)))
    monkeypatch.setattr(KVCompWorker, "after_attention", guarded(KVCompWorker.after_attention))
    monkeypatch.setattr(KVCompWorker, "_compress", compressing(KVCompWorker._compress))
    return mode


def harness(tiny_model_dir, sinks: bool = False, **options) -> StepHarness:
    h = StepHarness(tiny_model_dir, **options)
    cache = h.worker.cache
    cache.pages, cache.cells = on_device(cache.pages), on_device(cache.cells)
    if sinks:  # gpt-oss style: a learned sink logit per query head, on the device
        heads = h.runner.num_heads
        h.worker.variants = [AttentionVariant(v.scale, sinks=on_device(torch.linspace(-1, 1, heads)))
                             for v in h.worker.variants]
    return h


def test_recorder_catches_reads_and_host_tensors_from_engine_code(stalls):
    """The recorder can fail: a read back and a pageable copy written as engine code are found."""
    device, host = on_device(torch.arange(4)), torch.arange(4)
    code = compile("device.sum().item()\ndevice + host\nint(device.max())", f"{ENGINE}/probe.py", "exec")
    with stalls:
        exec(code, {"device": device, "host": host})
        device.sum().item()  # this module's own reads do not count
    assert len(stalls.found) == 3, stalls.found
    assert stalls.found[0].startswith("read back") and stalls.found[1].startswith("host tensor")


@pytest.mark.parametrize("policy", [p for p in POLICY_NAMES if p != "full"])
def test_no_stall_in_decode_steps(tiny_model_dir, stalls, policy):
    """Two requests of every policy through prefill, their compressions and 40 decode steps
    (recompressions where the policy makes them): no read back and no pageable copy by engine
    code outside the compressions."""
    h = harness(tiny_model_dir, sinks=policy == "razor")
    for rid, seed in (("a", 1), ("b", 2)):
        h.add(rid, ids(600, seed), policy, max_tokens=40, **spec_for(policy))
    h.run_until_idle()
    assert all(len(h.outputs[r]) == 40 for r in "ab")
    assert stalls.checked > 100, "too few device operations seen for the test to mean anything"
    assert stalls.found == [], stalls.found[:10]


@pytest.mark.parametrize("spec", [{"policy": "snapkv", "prefill": "block"}, {"policy": "lagkv", "prefill": "stream"},
                                  {"policy": "razor", "prefill": "stream"}, {"policy": "h2o", "prefill": "block"}],
                         ids=lambda s: f"{s['policy']}-{s['prefill']}")
def test_no_stall_in_prefill_chunk_steps(tiny_model_dir, stalls, spec):
    """Prompts in 128-token chunks that compress as they go (their later chunks attend packed
    pages: many query rows per sequence), next to a decoding request: no stall either."""
    h = harness(tiny_model_dir, max_num_batched_tokens=128, sinks=spec["policy"] == "razor")
    h.add("d", ids(300, 5), spec["policy"], max_tokens=30, **spec_for(spec["policy"]))
    h.step_until(lambda h: h.compressed("d"))
    h.add("p", ids(700, 6), spec["policy"], max_tokens=4, **spec_for(spec["policy"], prefill=spec["prefill"]))
    h.run_until_idle()
    assert len(h.outputs["p"]) == 4 and h.sched.requests == {}
    assert stalls.checked > 100
    assert stalls.found == [], stalls.found[:10]


class CountedRanks(Ranks):
    """Two ranks whose other rank holds the same values; counts the collectives."""

    size = 2

    def __init__(self):
        self.calls = 0

    def gather(self, value):
        self.calls += 1
        return [value, value]


def test_no_collective_in_a_step_without_compression(tiny_model_dir, monkeypatch):
    """Under tensor parallelism a step only talks to the other ranks inside a compression (to
    agree on what to keep and on the longest head): 8 compressed requests decoding make no
    collective in the steps that compress nothing, whatever the batch."""
    h = StepHarness(tiny_model_dir, max_num_seqs=8)
    ranks = h.worker.ranks = CountedRanks()
    compressions = []
    compress = KVCompWorker._compress
    monkeypatch.setattr(KVCompWorker, "_compress",
                        lambda self, *a, **k: compressions.append(1) or compress(self, *a, **k))
    policies = ["snapkv", "h2o", "lagkv", "tova", "razor", "entropy", "streamingllm", "knorm"]
    for i, policy in enumerate(policies):
        h.add(f"r{i}", ids(300, 30 + i), policy, max_tokens=24, **spec_for(policy))
    quiet = 0
    while h.busy:
        before, done = ranks.calls, len(compressions)
        h.step()
        if len(compressions) == done:
            assert ranks.calls == before, "a collective in a step that compressed nothing"
            quiet += 1
    assert quiet >= 10 and ranks.calls > 0  # compressions did agree across ranks


def test_a_packing_sends_its_rows_through_page_locked_memory(monkeypatch):
    """``to_device`` (a packing's rows, a decision's page tables) copies to a CUDA device from
    page-locked memory without waiting; the copy is recorded here, as this machine may have none."""
    calls = []
    to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self.clone())
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append(("to", *a, k)) or to(self, "cpu"))
    host = torch.arange(6)
    out = staging.to_device(host, torch.device("cuda"))
    assert calls == ["pin", ("to", torch.device("cuda"), {"non_blocking": True})]
    assert torch.equal(out, host)
    calls.clear()
    assert staging.to_device(host, torch.device("cpu")) is host and calls == [("to", torch.device("cpu"), {})]


@pytest.mark.gpu
def test_to_device_on_a_gpu_gives_the_same_values():
    host = torch.randint(0, 1 << 20, (100_000,))
    out = staging.to_device(host, torch.device("cuda"))
    assert out.device.type == "cuda" and torch.equal(out.cpu(), host)
