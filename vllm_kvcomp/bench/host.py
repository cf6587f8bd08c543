"""Host time of kvcomp's attention hook per layer, by batch size, with the kernels stubbed.

On a GPU the host must stay ahead of the device: whatever Python the hook runs per layer is time
the GPU may wait. This benchmark drives the worker (:class:`~vllm_kvcomp.engine.worker.KVCompWorker`)
over a :class:`~vllm_kvcomp.engine.cache.CudaPagedCache` as vLLM would in steady decode, every
request compressed (``--kept`` cells per head) and decoding one token a step, and times on the
host: each layer's hook after the step's first (what every layer costs), the first layer (which
plans the step and makes its one transfer) and the whole step (bind, every layer, finish) per
layer. The kernels are stubbed (``--kernels real`` on a GPU launches them), so the figures are
the hook's own. Configurations: ``plain``; ``tokens`` (a compensation token in every head, as
razor's); ``capture`` (every request captures its queries every step, as recompressing policies
do between recompressions). No vLLM engine and no model: the caches are a small buffer (the
stubbed kernels read nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from dataclasses import dataclass

import torch

from vllm_kvcomp.bench.common import module_main, write_report

CONFIGS = ("plain", "tokens", "capture")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="meta,cpu",
                        help="torch devices of the caches and queries, comma-separated: meta (no data: the host "
                             "alone), cpu (with the copies a CPU makes), cuda")
    parser.add_argument("--batches", default="1,8,64", help="compressed requests per step, comma-separated")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kept", type=int, default=512, help="cells each head keeps (a multiple of the block size)")
    parser.add_argument("--steps", type=int, default=48, help="decode steps timed per batch (after 8 of warm-up)")
    parser.add_argument("--kernels", choices=("stub", "real"), default="stub",
                        help="real: launch the device kernels too (a GPU; the caches are then allocated in full)")


@dataclass
class Timing:
    device: str
    config: str
    batch: int
    layer_us: float  # median host µs of a layer's hook, layers after the first
    first_us: float  # median host µs of the first layer's hook (the step's plan and transfer)
    step_us: float  # median host µs of a whole step (bind, layers, finish) per layer
    transfers: float  # host-to-device transfers per step
    rebuilds: int  # whole page-table rebuilds over the timed steps


def run(args: argparse.Namespace) -> int:
    devices = [torch.device(d.strip()) for d in args.device.split(",") if d.strip()]
    batches = [int(b) for b in args.batches.split(",")]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    if args.kept % args.block_size:
        raise SystemExit(f"--kept must be a multiple of --block-size ({args.block_size})")
    if args.kernels == "real" and any(d.type != "cuda" for d in devices):
        raise SystemExit("--kernels real needs --device cuda")
    rows = [time_config(args, device, config, batch) for device in devices for config in configs for batch in batches]
    body = _report(args, rows)
    print(body)
    write_report(args.out, args.command, body)
    return 0


def time_config(args: argparse.Namespace, device: torch.device, config: str, batch: int) -> Timing:
    """One configuration at one batch size (a fresh worker)."""
    from vllm_kvcomp.engine.metadata import StepMetadata

    worker, requests = _worker(args, device, config, batch)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]
    heads = args.kv_heads * args.group
    query = torch.randn(batch, heads, args.head_dim, device=device, dtype=_dtype(device))
    output = torch.zeros_like(query)
    per_layer, first, whole = [], [], []
    warmup = 8
    with _stubbed_kernels(query) if args.kernels == "stub" else contextlib.nullcontext():
        for step in range(warmup + args.steps):
            if step == warmup:
                sends, rebuilds = worker.staging.sends, worker.tables.rebuilds
            for r in requests:
                r.num_computed += 1
            started = time.perf_counter()
            worker.bind(StepMetadata(requests=requests))
            worker.set_batch([r.req_id for r in requests], dict.fromkeys((r.req_id for r in requests), 1))
            t0 = time.perf_counter()
            worker.after_attention(layers[0], query, output)
            t1 = time.perf_counter()
            for name in layers[1:]:
                worker.after_attention(name, query, output)
            t2 = time.perf_counter()
            worker.finish_step()
            worker.take_report()
            worker.clear_step()
            ended = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # outside the timed span: the queue never backs up
            if step >= warmup:
                first.append(t1 - t0)
                per_layer.append((t2 - t1) / max(args.layers - 1, 1))
                whole.append((ended - started) / args.layers)
    return Timing(_device_name(device), config, batch, 1e6 * statistics.median(per_layer), 1e6 * statistics.median(first),
                  1e6 * statistics.median(whole), (worker.staging.sends - sends) / args.steps,
                  worker.tables.rebuilds - rebuilds)


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _worker(args: argparse.Namespace, device: torch.device, config: str, batch: int):
    """A worker with ``batch`` compressed requests in decode (pages packed as a compression
    leaves them: ``kept`` cells per head, the tail in its own block)."""
    from vllm_kvcomp.engine.cache import AttentionVariant, CudaPagedCache
    from vllm_kvcomp.engine.metadata import ScheduledRequest, StepMetadata
    from vllm_kvcomp.engine.pages import RequestPages
    from vllm_kvcomp.engine.worker import KVCompWorker
    from vllm_kvcomp.policies.base import Compensation
    from vllm_kvcomp.spec import CompressionSpec

    bs, heads, dim = args.block_size, args.kv_heads, args.head_dim
    packed_blocks = -(-args.kept * args.layers * heads // bs // (args.layers * heads))  # kept / bs pages per head
    tail_blocks = (8 + args.steps) // bs + 2
    per_request = packed_blocks + tail_blocks
    num_blocks = 1 + batch * per_request if args.kernels == "real" else 2
    buffer = torch.zeros(args.layers, num_blocks, heads, bs, 2 * dim, device=device, dtype=_dtype(device))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]
    worker = KVCompWorker(block_size=bs, policy_builder=lambda spec: spec.build_policy())
    worker.register({n: buffer[i] for i, n in enumerate(names)}, {n: i for i, n in enumerate(names)}, CudaPagedCache,
                    {n: AttentionVariant(dim**-0.5) for n in names}, args.layers)
    geometry = worker.cache.geometry
    spec = CompressionSpec(policy="snapkv", ratio=0.25).to_dict()
    prompt = 4 * args.kept
    requests = []
    for r in range(batch):
        first = 1 + r * per_request
        blocks = [0] * (prompt // bs - packed_blocks) + list(range(first, first + per_request))
        requests.append(ScheduledRequest(f"r{r}", spec, prompt, prompt - 1, 1, blocks))
    worker.bind(StepMetadata(requests=requests))  # the requests' states
    counts = torch.full((args.layers, heads), args.kept // bs, dtype=torch.long)
    for sched in requests:
        state = worker.requests[sched.req_id]
        own = torch.tensor(sched.block_ids[prompt // bs - packed_blocks : prompt // bs])
        packed = geometry.page_ids(own)  # [L, H, packed]: each head its own page of those blocks
        positions = [[torch.arange(prompt - args.kept, prompt) for _ in range(heads)] for _ in range(args.layers)]
        state.pages = RequestPages(geometry, packed, counts.clone(), positions, tail_col=prompt // bs,
                                   first_live_col=prompt // bs - packed_blocks)
        state.lifecycle.prompt_complete(prompt)
        state.lifecycle.compressed()
        if config == "tokens":
            state.compensation = [Compensation(torch.randn(heads, dim), torch.randn(heads, dim), torch.full((heads,), 3.0))
                                  for _ in range(args.layers)]
        if config == "capture":  # between recompressions, a recompressing policy captures every step
            state.captures = lambda end, drafts: True
    worker.clear_step()
    return worker, requests


@contextlib.contextmanager
def _stubbed_kernels(query: torch.Tensor):
    """The attention kernels replaced by a stub that returns a preallocated output."""
    from vllm_kvcomp import kernels

    out = torch.zeros_like(query).view(-1)
    saved = kernels.decode_attention, kernels.prefill_attention

    def stub(q, *args, **kwargs):
        return out[: q.numel()].view(q.shape), None

    kernels.decode_attention = kernels.prefill_attention = stub
    try:
        yield
    finally:
        kernels.decode_attention, kernels.prefill_attention = saved


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "meta (host alone)" if device.type == "meta" else f"CPU ({os.cpu_count()} cores)"


def _report(args: argparse.Namespace, rows: list[Timing]) -> str:
    lines = [
        f"Host time of the kvcomp hook, torch {torch.__version__}; {args.layers} layers, {args.kv_heads} KV "
        f"heads x {args.group} query heads, head dim {args.head_dim}, block size {args.block_size}, {args.kept} "
        f"cells kept per head, one decode token per request per step, kernels {args.kernels}; median of "
        f"{args.steps} steps. Target: <= 30 us per layer, flat in the batch.",
        "",
        "| device | config | compressed requests | us per layer | first layer us (plan + transfer) | step us per "
        "layer (bind, layers, finish) | transfers per step | table rebuilds |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for t in rows:
        lines.append(f"| {t.device} | {t.config} | {t.batch} | {t.layer_us:.1f} | {t.first_us:.0f} | {t.step_us:.1f} | "
                     f"{t.transfers:.1f} | {t.rebuilds} |")
    lines += ["", "On `meta` tensors carry no data: the figures are the host's own work (Python and torch's "
              "dispatch), what a GPU's host thread spends before its launches. On `cpu` every copy also runs "
              "(a capture moves each request's queries of every layer), as it would not on a GPU's host."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from vllm_kvcomp.bench import host

    return module_main(host, "host", argv)


if __name__ == "__main__":
    raise SystemExit(main())
