"""Kept fraction of every policy at its default settings on a model, via the HF oracle.

A markdown table: policy x prompt length -> kept fraction of all (layer, head, token) cells right
after prefill compression, and the largest head's kept count, which is what the engine's shared
block table frees down to. Example::

    vllm-kvcomp bench kept --lengths 2048,4096
    python -m vllm_kvcomp.bench.kept --lengths 2048 --policies snapkv,h2o
"""

from __future__ import annotations

import argparse
import sys

import torch

from vllm_kvcomp.bench.common import module_main, write_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vllm_kvcomp.spec import POLICY_NAMES

    parser.add_argument("--model", default=None, help="HF model folder (default: the bundled SmolLM2)")
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))


def run(args: argparse.Namespace) -> int:
    from vllm_kvcomp.calibration.profiles import load_for_policy
    from vllm_kvcomp.models import fetch_default_model
    from vllm_kvcomp.oracle import generate, load_model
    from vllm_kvcomp.spec import CompressionSpec

    model_dir = args.model or str(fetch_default_model())
    model = load_model(model_dir)
    cfg = model.config
    cells_per_token = cfg.num_hidden_layers * cfg.num_key_value_heads
    gen = torch.Generator().manual_seed(args.seed)
    lengths = [int(x) for x in args.lengths.split(",")]
    table = [
        "| policy | " + " | ".join(f"N={n} kept (max head)" for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    print("\n".join(table))
    prompts = {n: torch.randint(100, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths}
    for name in args.policies.split(","):
        policy = load_for_policy(CompressionSpec(policy=name).build_policy(), model_dir)
        row = []
        for n in lengths:
            result = generate(model, prompts[n], policy, 1)
            if not result.compressions:
                row.append("1.000 (all)")
                continue
            kept = result.compressions[0]["kept"]  # [layer][head]
            total = sum(sum(layer) for layer in kept)
            row.append(f"{total / (n * cells_per_token):.3f} ({max(max(layer) for layer in kept)})")
        table.append(f"| {name} | " + " | ".join(row) + " |")
        print(table[-1], flush=True)
    write_report(args.out, args.command, "\n".join(table))
    return 0


def main(argv: list[str] | None = None) -> int:
    return module_main(sys.modules[__name__], "kept", argv)


if __name__ == "__main__":
    sys.exit(main())
