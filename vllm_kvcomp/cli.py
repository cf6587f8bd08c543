"""``vllm-kvcomp serve | model | calibrate | eval | bench``: one dispatcher, lazy subcommands.

Each subcommand lives with its area and exposes ``add_arguments(parser)`` and ``run(args)``;
only the chosen one is imported. ``serve`` forwards unknown flags to vLLM and ``bench`` picks a
benchmark by name, so both take the raw arguments (their ``main(argv)``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

DESCRIPTION = "vLLM's OpenAI server with per-request KV-cache compression, and its tools."
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("vllm_kvcomp.server.cli", "start the OpenAI-compatible server with compression"),
    "model": ("vllm_kvcomp.models", "fetch / locate a model"),
    "calibrate": ("vllm_kvcomp.calibration.cli", "build per-model calibration profiles"),
    "eval": ("vllm_kvcomp.eval.cli", "measure quality of policies through a server"),
    "bench": ("vllm_kvcomp.bench", "run a benchmark"),
}
RAW_ARGV = ("serve", "bench")  # subcommands that parse their own arguments: main(argv)
EPILOG = """\
examples:
  vllm-kvcomp model list
  vllm-kvcomp serve --port 8000
  vllm-kvcomp serve gemma-3-270m --port 8000 --kv-compression-config configs/lagkv.yaml
  vllm-kvcomp bench --list
  vllm-kvcomp eval --help

'vllm-kvcomp COMMAND --help' shows a command's options and examples; configs/ is in the
repository and in the images (/opt/vllm-kvcomp/configs)."""


def summary(name: str) -> str:
    """Subcommand ``name``'s one line; ``model`` and ``bench`` list every model / benchmark."""
    text = SUBCOMMANDS[name][1]
    if name == "model":
        from vllm_kvcomp.models import MODEL_NAME, SOURCES

        return f"{text}: " + ", ".join(f"{m} (default)" if m == MODEL_NAME else m for m in SOURCES)
    if name == "bench":
        from vllm_kvcomp.bench import BENCHMARKS, DEFAULT

        return f"{text}: " + ", ".join(f"{b} (default)" if b == DEFAULT else b for b in BENCHMARKS)
    return text


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-kvcomp", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        sub.add_parser(name, help=summary(name))
    return parser


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of ``vllm-kvcomp NAME`` for a subcommand not in :data:`RAW_ARGV`."""
    parser = argparse.ArgumentParser(prog=f"vllm-kvcomp {name}", description=summary(name),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    importlib.import_module(SUBCOMMANDS[name][0]).add_arguments(parser)
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
    return int(module.run(subcommand_parser(name).parse_args(rest)) or 0)


if __name__ == "__main__":
    sys.exit(main())
