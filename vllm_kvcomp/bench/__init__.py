"""``vllm-kvcomp bench [NAME] [ARGS]``: the one runner of vllm-kvcomp's benchmarks.

NAME is one of :data:`BENCHMARKS`; without one (or when the first argument starts with ``-``) it
runs ``engine``, so ``vllm-kvcomp bench --skip-overhead`` keeps working. ``--list`` prints the
names. Every benchmark also runs as ``python -m vllm_kvcomp.bench.<name>`` and writes its result
table to ``--out`` (default ``docs/results/bench_<name>.md``) under the exact command line.
"""

from __future__ import annotations

import importlib
import sys

from vllm_kvcomp.bench.common import default_out, run_benchmark

BENCHMARKS: dict[str, tuple[str, str]] = {
    "cost": ("vllm_kvcomp.bench.cost", "compression seconds as a share of TTFT, per policy, one request"),
    "engine": ("vllm_kvcomp.bench.engine", "memory and throughput inside vLLM, full vs policies"),
    "host": ("vllm_kvcomp.bench.host", "host time of the attention hook per layer by batch size, kernels stubbed"),
    "kernels": ("vllm_kvcomp.bench.kernels", "decode-attention kernel bandwidth vs device copy"),
    "kept": ("vllm_kvcomp.bench.kept", "kept fraction of every policy after prefill (HF oracle)"),
    "memory": ("vllm_kvcomp.bench.memory", "peak memory of one compression outside the KV pool vs the start-up bound"),
    "multiturn": ("vllm_kvcomp.bench.multiturn", "multi-turn chat with prefix caching: hits, TTFT, KV per turn"),
    "peak": ("vllm_kvcomp.bench.peak", "through the server: peak KV one request holds around its compaction vs full"),
    "pages": ("vllm_kvcomp.bench.pages", "through the server: KV held, admission, decode speed vs full"),
    "prefill": ("vllm_kvcomp.bench.prefill", "KV held during prefill: compress per chunk vs at the end vs full"),
    "stall": ("vllm_kvcomp.bench.stall", "the longest step carrying compression work vs the median decode step"),
    "soak": ("vllm_kvcomp.bench.soak", "mixed policies, aborts, preemption for minutes: 5xx, leaks, KV at idle"),
}
DEFAULT = "engine"
PROG = "vllm-kvcomp bench"
EXAMPLES = f"""\
examples (without --out a run rewrites its current file under docs/results/):
  {PROG} --list
  {PROG} kernels --device cpu --out /tmp/bench_kernels.md
  {PROG} kept --policies snapkv,lagkv --lengths 512 --out /tmp/bench_kept.md
  {PROG} cost --policies full,snapkv --runs 1 --out /tmp/bench_cost.md
  {PROG} pages --help"""


def _writes(name: str) -> str:
    out = default_out(name)
    return "prints only unless --out" if out is None else f"writes {out}"


def usage() -> str:
    """The runner's help: its two forms and the benchmarks with their default output files."""
    width = max(map(len, BENCHMARKS))
    lines = [
        f"usage: {PROG} [NAME] [ARGS ...] | {PROG} --list",
        "",
        "Run one benchmark: it prints its result table and writes it as markdown to --out.",
        "",
        "benchmarks:",
        *(f"  {name:<{width}} {text} ({_writes(name)})" for name, (_, text) in BENCHMARKS.items()),
        "",
        f"Without NAME, or when the first argument starts with '-', runs {DEFAULT}.",
        f"'{PROG} NAME --help' shows a benchmark's options.",
        "",
        EXAMPLES,
    ]
    return "\n".join(lines)


def select(argv: list[str]) -> tuple[str, list[str]]:
    """The benchmark ``argv`` names (``engine`` without a name) and its own arguments; exits 2 on an
    unknown name."""
    explicit = bool(argv) and not argv[0].startswith("-")
    name = argv[0] if explicit else DEFAULT
    if name not in BENCHMARKS:
        print(usage(), file=sys.stderr)
        print(f"\n{PROG}: unknown benchmark {name!r} (choose from {', '.join(BENCHMARKS)})",
              file=sys.stderr)
        raise SystemExit(2)
    return name, argv[1:] if explicit else argv


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark named by ``argv[0]`` (default ``engine``) with the remaining arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        raise SystemExit(0)
    if argv[:1] == ["--list"]:
        print("\n".join(BENCHMARKS))
        return 0
    name, rest = select(argv)
    module = importlib.import_module(BENCHMARKS[name][0])
    return run_benchmark(module, name, rest, [*PROG.split(), *argv])
