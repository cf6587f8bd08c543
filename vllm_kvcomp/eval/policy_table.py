"""The overview table of docs/policies.md, generated from the policy registry so it cannot drift.

Every cell but the quality column comes from the policy's class: what it keeps (``KEEPS``), its
paper (``PAPER``), parameters, defaults and ranges (:meth:`Policy.accepted_params` and its
dataclass defaults; ``IMPLICIT_DEFAULTS`` for a default that ``None`` stands for), calibration
(``PROFILE``), how it compresses during prefill (``STREAMS``: ``stream``, else ``block``). The quality column is measured: from a results
JSONL (``--results``) or kept as it stands in the document.

    python3 -m vllm_kvcomp.eval.policy_table --write docs/policies.md \\
        [--results docs/results/quality/power.jsonl]
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from vllm_kvcomp.eval.stats import wilson
from vllm_kvcomp.policies.registry import get_policy_class, policy_names

START = "<!-- policy-table:start (generated: python3 -m vllm_kvcomp.eval.policy_table) -->"
END = "<!-- policy-table:end -->"
PENDING = "pending (issue #17 run)"


def _text(value: Any) -> str:
    if value is None:
        return "–"
    return f"{value:g}" if isinstance(value, float) else str(value)


def span(param: Any) -> str:
    """A parameter's accepted values, compactly: ``(0, 1]``, ``≥ 0``, ``1–63``, ``a | b``."""
    if param.choices:
        return " \\| ".join(param.choices)
    if param.kind is str:
        return "name"
    if param.name == "ratio":
        return "(0, 1]"
    low, high = _text(param.low), _text(param.high)
    if param.kind is int and (param.high is None or param.high >= 1 << 16):
        return f"≥ {low}"
    return f"{low}–{high}"

#: spec keys every policy accepts alike, left out of the rows
SHARED = ("scope", "context_tokens", "decode")


def parameters(name: str) -> str:
    """``key=default (range)`` for every key a spec may set, ``prefill`` last, ``;``-separated;
    ``scope``, ``context_tokens`` and ``decode`` (every policy's, the same) are described above the table."""
    cls = get_policy_class(name)
    defaults = {f.name: f.default for f in fields(cls) if f.default is not MISSING}
    accepted = cls.accepted_params()
    keys = [k for k in accepted if k not in ("prefill", *SHARED)] + [k for k in accepted if k == "prefill"]
    shown = {k: _text(defaults[k]) if defaults.get(k) is not None else cls.IMPLICIT_DEFAULTS.get(k, "–")
             for k in keys}  # None: what it stands for, in words
    parts = [f"`{k}`={shown[k]} ({span(accepted[k])})" for k in keys]
    return "; ".join(parts) or "–"


def row(name: str, quality: str) -> str:
    cls = get_policy_class(name)
    calibration = f"yes (`{cls.PROFILE}` profile)" if cls.PROFILE else "no"
    streams = "no" if name == "full" else "`stream`" if cls.STREAMS else "`block`"
    return (f"| `{name}` | {cls.KEEPS} | {parameters(name)} | {cls.PAPER} | {calibration} | "
            f"{streams} | {quality} |")


def table(quality: Mapping[str, str] | None = None) -> str:
    """The markdown table (between its markers); ``quality`` per policy, else :data:`PENDING`."""
    quality = quality or {}
    lines = [START, "| policy | keeps | parameters: default (range) | paper | calibration | "
             "compresses during prefill | quality at 0.25 (2K, all tasks, 95% CI) |",
             "|---|---|---|---|---|---|---|"]
    lines += [row(name, quality.get(name, PENDING)) for name in policy_names()]
    return "\n".join([*lines, END])


def current_quality(doc: str) -> dict[str, str]:
    """The quality column as it stands in ``doc``'s table."""
    block = doc[doc.index(START): doc.index(END)] if START in doc and END in doc else ""
    out = {}
    for line in block.splitlines():
        found = re.match(r"\| `([a-z0-9_]+)` \|", line)
        if found:
            out[found.group(1)] = line.rstrip(" |").rsplit("|", 1)[-1].strip()
    return out


def measured_quality(records: Sequence[dict[str, Any]], ratio: float = 0.25,
                     length: int = 2048) -> dict[str, str]:
    """Per policy at its defaults: mean score over every task's samples at ``ratio`` (``full``:
    1) and ``length``, with the Wilson interval over the pooled samples and the mean kept."""
    from vllm_kvcomp.eval.cells import condition_of, latest

    pooled: dict[str, list[dict[str, Any]]] = {}
    for r in latest(records):
        wanted = 1.0 if r["policy"] == "full" else ratio
        if (not r.get("error") and condition_of(r) == r["policy"] and int(r["length"]) == length
                and abs(float(r["ratio"]) - wanted) < 1e-9):
            pooled.setdefault(r["policy"], []).append(r)
    out = {}
    for name, items in pooled.items():
        mean = sum(r["score"] for r in items) / len(items)
        low, high = wilson(mean, len(items))
        kept = [r["kept_fraction"] for r in items if r.get("kept_fraction") is not None]
        held = f", kept {sum(kept) / len(kept):.2f}" if kept else ""
        out[name] = f"{mean:.2f} [{low:.2f}, {high:.2f}] (n={len(items)}{held})"
    return out


def rewrite(doc: str, quality: Mapping[str, str] | None = None) -> str:
    """``doc`` with its table regenerated (quality: given, else as it stands)."""
    if START not in doc or END not in doc:
        raise ValueError(f"no generated table markers in the document ({START} ... {END})")
    kept = {**current_quality(doc), **(quality or {})}
    return doc[: doc.index(START)] + table(kept) + doc[doc.index(END) + len(END):]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m vllm_kvcomp.eval.policy_table",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", help="markdown file whose table to regenerate in place")
    parser.add_argument("--results", help="results JSONL to fill the quality column from")
    args = parser.parse_args(argv)
    quality = None
    if args.results:
        from vllm_kvcomp.eval.runner import read_jsonl

        quality = measured_quality(read_jsonl(Path(args.results)))
    if not args.write:
        print(table(quality))
        return 0
    path = Path(args.write)
    path.write_text(rewrite(path.read_text(encoding="utf-8"), quality), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
