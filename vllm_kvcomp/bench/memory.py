"""Peak memory one compression holds outside the KV pool, per policy, against the start-up bound.

vLLM-free: the worker's own decision (``KVCompWorker.decide``, reading the request one layer at
a time) and packing (``RequestPages.compact`` then ``PagedCache.move``, in place and into spare
blocks as copy-on-compress does; the plan's index arrays included) over a synthetic cache of the model's shapes, one request of
each length, its query window full. The peak is the allocator's: on the host the CPU allocator's
"Total Allocated" as ``torch.profiler`` records it (every thread), on a GPU
``torch.cuda.max_memory_allocated``, less what was allocated before. Beside it: the bound the
engine logs and exports at start-up (:mod:`~vllm_kvcomp.engine.memory`) for ``max_model_len`` =
the length, and the request's whole K+V (what a decision read at once before). Example::

    vllm-kvcomp bench memory --lengths 8192,32768 --policies snapkv,h2o,lagkv
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from vllm_kvcomp.bench.common import module_main, write_report

#: the bundled SmolLM2-135M's attention shapes
BUNDLED = {"layers": 30, "kv_heads": 3, "group": 3, "head_dim": 64}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", default="8192,32768", help="prompt lengths (comma list)")
    parser.add_argument("--policies", default=None, help="comma list of policy labels (default: every policy and variant)")
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--widest", action="store_true",
                        help="every policy that reads queries at the widest window (--window as its window or observe)")
    parser.add_argument("--window", type=int, default=512, help="the widest window the bound is computed for")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    for name, value in BUNDLED.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)


def peak_bytes(fn: Callable[[], object], device: str) -> int:
    """The most bytes allocated at once while ``fn`` runs, above what was allocated before."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = [e["args"] for e in json.loads(trace.read_text())["traceEvents"]
                  if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    if not events:
        return 0
    before = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - before


def run(args: argparse.Namespace) -> int:
    from vllm_kvcomp.bench.kernels import decide_policies
    from vllm_kvcomp.engine.cache import AttentionVariant, CpuPagedCache, CudaPagedCache
    from vllm_kvcomp.engine.memory import PluginMemory, Shapes
    from vllm_kvcomp.engine.pages import RequestPages
    from vllm_kvcomp.engine.state import CompressedRequest, QueryWindow
    from vllm_kvcomp.engine.worker import KVCompWorker
    from vllm_kvcomp.policies.base import RequestState
    from vllm_kvcomp.spec import CompressionSpec

    dev, nl, hk, d, bs = args.device, args.layers, args.kv_heads, args.head_dim, args.block_size
    hq = hk * args.group
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    policy_args = argparse.Namespace(layers=nl, kv_heads=hk, group=args.group, head_dim=d,
                                     policies=args.policies, decide_ratio=args.ratio)
    policies = [(label, _widest(p, args.window) if args.widest else p)
                for label, p in decide_policies(policy_args) if label != "full"]
    lengths = [int(x) for x in args.lengths.split(",")]
    gen = torch.Generator(device=dev).manual_seed(3)
    table = [f"Shapes: {nl} layers, {hk} KV heads, {hq} query heads, D={d}, {dtype}, block {bs}, "
             f"ratio {args.ratio:g}, device {dev}; bound for a window of {args.window}"
             + ("; every policy that reads queries at that window." if args.widest else
                "; the policies at their default settings."), "",
             "| policy | N | decide | pack in place | pack to spares | peak / bound | bound | whole K+V |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(table), flush=True)
    worst, points = 0.0, []
    for n in lengths:
        blocks = -(-n // bs)
        storage = torch.randn(nl, 2 * blocks + 1, hk, bs, 2 * d, generator=gen, device=dev, dtype=dtype)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(nl)]
        shapes = Shapes(nl, hk, hq, d, storage.element_size(), n, bs, args.window, host=dev == "cpu")
        bound = PluginMemory.bound(shapes)
        whole = 2 * nl * hk * n * d * storage.element_size()
        for label, policy in policies:
            worker = KVCompWorker(block_size=bs, policy_builder=CompressionSpec.build_policy)
            worker.register({name: storage[i] for i, name in enumerate(names)}, {name: i for i, name in enumerate(names)},
                            CpuPagedCache if dev == "cpu" else CudaPagedCache,
                            {name: AttentionVariant(scale=d**-0.5) for name in names}, nl,
                            {name: torch.randn(hq * d, hq * d, generator=gen, device=dev, dtype=dtype) * d**-0.5
                             for name in names})
            worker.configure_offload(0)
            w = policy.queries_needed()
            state = CompressedRequest(spec=CompressionSpec(), policy=policy, pages=RequestPages(worker.cache.geometry),
                                      policy_state=RequestState(prompt_len=n), window=QueryWindow(w),
                                      compensation=[None] * nl)
            if w:
                state.window.push(torch.randn(w, nl, hq, d, generator=gen, device=dev, dtype=dtype), n - w)
            block_ids = torch.arange(blocks + 1)
            decided: list = []
            decide = peak_bytes(functools.partial(_decide, worker, state, block_ids, n, decided), dev)
            decision = decided[0]
            packs = []
            for spares in (False, True):
                destination = None
                if spares and decision.compacts:
                    needed = state.pages.blocks_needed(decision.kept, n)
                    destination = (blocks + 1 + torch.arange(needed)).tolist()
                packs.append(peak_bytes(functools.partial(_pack, worker, state, decision, block_ids, destination), dev)
                             if decision.compacts else 0)
            peak = max(decide, *packs)
            worst = max(worst, peak / bound.reserved)
            points.append(Point(label, n, decide, max(packs), bound.reserved, shapes.layer_kv(), whole))
            table.append(f"| {label} | {n} | {_mib(decide)} | {_mib(packs[0])} | {_mib(packs[1])} | "
                         f"{peak / bound.reserved:.2f} | {_mib(bound.reserved)} | {_mib(whole)} |")
            print(table[-1], flush=True)
    table += ["", f"Largest peak / bound: {worst:.2f} (target <= 1). MiB = 2^20 bytes. The bound's parts at the "
              f"last length: {bound.describe()}."]
    if args.out is not None:
        image = plot(points, args.out.with_suffix(".png"))
        table += ["", f"![peak of each policy's decision and packing against the bound]({image.name})"]
    write_report(args.out, args.command, "\n".join(table))
    return 0


@dataclasses.dataclass(frozen=True)
class Point:
    """One policy at one length: its peaks and the lines they are read against (bytes)."""

    label: str
    n: int
    decide: int
    pack: int  # the larger of in place and into spares
    bound: int
    layer_kv: int
    whole: int


def plot(points: list[Point], path: Path) -> Path:
    """One PNG, a panel per length: each policy's decision and packing peaks (MiB) against the
    bound, one layer's K+V and the request's whole K+V."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({p.n for p in points})
    labels = list(dict.fromkeys(p.label for p in points))
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 0.32 * len(labels) + 1.6), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        mine = {p.label: p for p in points if p.n == n}
        rows = range(len(labels))
        ax.barh([r - 0.2 for r in rows], [mine[x].decide / 2**20 for x in labels], height=0.4, label="decision")
        ax.barh([r + 0.2 for r in rows], [mine[x].pack / 2**20 for x in labels], height=0.4, label="packing")
        first = mine[labels[0]]
        for value, style, name in ((first.bound, "-", "bound (reserved)"), (first.layer_kv, ":", "one layer's K+V"),
                                   (first.whole, "--", "the request's whole K+V")):
            ax.axvline(value / 2**20, color="k", linestyle=style, label=name)
        ax.set_yticks(list(rows), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set(title=f"N = {n}", xlabel="MiB")
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _widest(policy, window: int):
    """``policy`` with the field that sizes its query window (``observe``, else ``window``) at
    ``window`` (a wrapper's inner policy; one with neither, or that reads no queries, as it is)."""
    if policy.queries_needed() == 0:
        return policy
    if not isinstance(getattr(policy, "inner", ""), str):
        return dataclasses.replace(policy, inner=_widest(policy.inner, window))
    from vllm_kvcomp.params import SpecError

    fields = {f.name for f in dataclasses.fields(policy)}
    for name in ("observe", "window"):
        if name in fields:
            try:
                return dataclasses.replace(policy, **{name: window})
            except SpecError:  # a setting of another inner policy (criticalkv)
                continue
    return policy


def _decide(worker, state, block_ids: torch.Tensor, n: int, out: list) -> None:
    out.append(worker.decide(state, block_ids, n, False, state.policy_state))


def _pack(worker, state, decision, block_ids: torch.Tensor, destination: list[int] | None) -> None:
    """The packing as the worker plans and writes it (the plan's index arrays count)."""
    move, _ = state.pages.compact(decision.kept, block_ids, decision.end, destination)
    worker.cache.move(move)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    return module_main(sys.modules[__name__], "memory", argv)


if __name__ == "__main__":
    sys.exit(main())
