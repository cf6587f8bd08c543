"""What every benchmark shares: the ``--out`` report file and its parser.

Each benchmark module exposes ``add_arguments(parser)`` and ``run(args)``; ``run`` prints its
table and writes it with :func:`write_report` to ``args.out`` (default
``docs/results/bench_<name>.md``), under the exact command line (``args.command``).
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import signal
import sys
from pathlib import Path
from types import ModuleType

RESULTS_DIR = Path("docs/results")


#: benchmarks whose runs several current files hold (one per phase or device: docs/results/README.md
#: says which) or none: without ``--out`` they print their table and write nothing
NO_SINGLE_FILE = {"engine", "kept", "kernels", "pages"}
#: benchmarks whose current file is not ``bench_<name>.md``
CURRENT = {"soak": RESULTS_DIR / "soak.md"}


def default_out(name: str) -> Path | None:
    """Where benchmark ``name`` writes its table unless ``--out`` says otherwise: its one current
    file under docs/results (None where it has several or none: it then only prints)."""
    if name in NO_SINGLE_FILE:
        return None
    return CURRENT.get(name, RESULTS_DIR / f"bench_{name}.md")


def model_line(model: str | None) -> str:
    """How a report names what was measured: the bundled model, a fetchable one by name, or a
    folder's name; then the numbers every CPU run shares."""
    name = "Bundled SmolLM2-135M" if model is None else Path(model).name
    return f"{name} (fp32, vLLM CPU, 2 cores)"


def spec_xargs(policy: str, ratio: float, settings: str = "") -> dict | None:
    """``SamplingParams.extra_args`` of ``policy`` at ``ratio`` with ``settings`` (header grammar,
    e.g. ``decode=recompress; window=16``); None for full cache."""
    if policy == "full":
        return None
    from vllm_kvcomp.spec import CompressionSpec

    header = "; ".join(p for p in (f"policy={policy}", f"ratio={ratio:g}", settings) if p)
    return CompressionSpec.from_header(header).to_xargs()


def build_parser(module: ModuleType, name: str, prog: str) -> argparse.ArgumentParser:
    """The benchmark's own flags plus ``--out``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(module.__doc__ or name).strip().splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(parser)
    out = default_out(name)
    if out is None:
        parser.add_argument("--out", type=Path,
                            help="markdown file for the result table (default: print it only; docs/results/README.md "
                                 "names the current file of each phase and device)")
    else:
        parser.add_argument("--out", type=Path, default=out,
                            help="markdown file for the result table (default: %(default)s, its current file, "
                                 "relative to the cwd)")
    return parser


def run_benchmark(module: ModuleType, name: str, argv: list[str], command: list[str]) -> int:
    """Parse ``argv`` for benchmark ``name`` and run it; ``command`` is the line as typed."""
    parser = build_parser(module, name, " ".join(command[: len(command) - len(argv)]))
    args = parser.parse_args(argv)
    args.command = shlex.join(command)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return int(module.run(args) or 0)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM (``timeout``, ``kill``, a CI runner) stops a benchmark as Ctrl-C does: the servers
    and engines it started are stopped on the way out instead of outliving it."""
    raise KeyboardInterrupt


def module_main(module: ModuleType, name: str, argv: list[str] | None) -> int:
    """``python -m vllm_kvcomp.bench.<name> ARGS``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_benchmark(module, name, argv, ["python", "-m", f"vllm_kvcomp.bench.{name}", *argv])


def write_report(path: Path | None, command: str, body: str) -> Path | None:
    """Write ``body`` (markdown) under a heading holding the command line; print and return the
    path (None: nothing is written)."""
    if path is None:
        print("not written: pass --out FILE to keep the table")
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    path.write_text(f"# `{command}`\n\nWritten {stamp}.\n\n{body.rstrip()}\n")
    print(f"wrote {path}")
    return path
