"""The Helm chart README's values table, generated from values.schema.json and values.yaml so it
cannot drift.

One row per value: dotted name, type (with the schema's bounds), default (values.yaml) and
description (the schema's). An object whose keys the schema lists gets a row, then one per key;
free-form objects, arrays and ``compression.policies`` (per-policy parameters,
docs/operator_config.md) are one row each. Every row needs a schema description.

    python3 scripts/helm_values_table.py            # print the table
    python3 scripts/helm_values_table.py --write    # regenerate it in the chart's README.md
    python3 scripts/helm_values_table.py --check    # exit 1 when the README's table is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "vllm-kvcomp"
README = CHART / "README.md"
START = "<!-- values-table:start (generated: python3 scripts/helm_values_table.py --write) -->"
END = "<!-- values-table:end -->"
ONE_ROW = frozenset({"compression.policies"})  # per-policy parameters: the schema checks them
UNSET = object()


def cell(text: str) -> str:
    """``text`` safe in a markdown table cell (pipes, HTML-like ``<key>``, emphasis)."""
    for raw, escaped in (("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("*", "\\*")):
        text = text.replace(raw, escaped)
    return " ".join(text.split())


def literal(value: Any) -> str:
    """A value as YAML/JSON flow text in a code span: ``"vllm-kvcomp"``, ``[]``, ``{"policy": "full"}``."""
    return "`" + json.dumps(value, separators=(", ", ": ")).replace("|", "\\|") + "`"


def bounds(node: dict[str, Any]) -> str:
    """`` in [1, 65535]``, `` ≥ 0`` or `` > 0`` from the schema's numeric limits."""
    low = ("[", node["minimum"]) if "minimum" in node else ("(", node.get("exclusiveMinimum"))
    high = ("]", node["maximum"]) if "maximum" in node else (")", node.get("exclusiveMaximum"))
    if low[1] is not None and high[1] is not None:
        return f" in {low[0]}{low[1]:g}, {high[1]:g}{high[0]}"
    if low[1] is not None:
        return f" {'≥' if low[0] == '[' else '>'} {low[1]:g}"
    if high[1] is not None:
        return f" {'≤' if high[0] == ']' else '<'} {high[1]:g}"
    return ""


def words(items: Sequence[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return " or ".join([", ".join(items[:-1]), items[-1]] if len(items) > 2 else items)


def type_of(node: dict[str, Any]) -> str:
    """The schema type in words: ``integer ≥ 1``, ``one of: Always, IfNotPresent, Never``,
    ``string or integer``, ``non-empty array of object``."""
    if "enum" in node:
        return "one of: " + ", ".join(v if isinstance(v, str) and v else json.dumps(v) for v in node["enum"])
    if "anyOf" in node:
        return words([type_of(branch) for branch in node["anyOf"]])
    kind = node.get("type", "any")
    non_empty = "non-empty " if node.get("minLength", 0) > 0 or node.get("minItems", 0) > 0 else ""
    if isinstance(kind, list):
        return non_empty + words(kind)
    if kind == "array" and "items" in node:
        items = node["items"]
        return f"{non_empty}array, items {type_of(items)}" if "enum" in items else f"{non_empty}array of {type_of(items)}"
    return non_empty + kind + bounds(node)


def rows(schema: dict[str, Any], values: Any, prefix: str = "") -> Iterator[tuple[str, str, str, str | None]]:
    """(name, type, default, description) of every value under ``schema``, in the schema's order."""
    for key, node in schema.get("properties", {}).items():
        name = f"{prefix}{key}"
        value = values.get(key, UNSET) if isinstance(values, dict) else UNSET
        nested = "properties" in node and name not in ONE_ROW
        default = "" if nested else "unset" if value is UNSET else literal(value)
        yield name, type_of(node), default, node.get("description")
        if nested:
            yield from rows(node, {} if value is UNSET else value, f"{name}.")


def table(schema: dict[str, Any], values: dict[str, Any]) -> str:
    """The markdown table between its markers; ValueError naming every value the schema leaves
    undescribed."""
    found = list(rows(schema, values))
    missing = [name for name, _, _, description in found if not description]
    if missing:
        raise ValueError(f"values.schema.json has no description for {', '.join(missing)}: "
                         "add a \"description\" to each, then rerun with --write")
    lines = [START, "| value | type | default | description |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {cell(kind)} | {default} | {cell(str(description))} |"
              for name, kind, default, description in found]
    return "\n".join([*lines, END])


def rewrite(doc: str, generated: str) -> str:
    """``doc`` with the text between its markers replaced by ``generated``."""
    if START not in doc or END not in doc:
        raise ValueError(f"no values-table markers in the README ({START} ... {END})")
    return doc[: doc.index(START)] + generated + doc[doc.index(END) + len(END):]


def load_chart() -> tuple[dict[str, Any], dict[str, Any]]:
    """The chart's values schema and default values."""
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    return schema, yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 scripts/helm_values_table.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="regenerate the table in the README in place")
    mode.add_argument("--check", action="store_true", help="exit 1 when the README's table is not the generated one")
    parser.add_argument("--readme", type=Path, default=README, help="the README (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        generated = table(*load_chart())
        if not (args.write or args.check):
            print(generated)
            return 0
        doc = args.readme.read_text(encoding="utf-8")
        updated = rewrite(doc, generated)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.write:
        args.readme.write_text(updated, encoding="utf-8")
    elif updated != doc:
        print(f"{args.readme}'s values table is out of date: run python3 scripts/helm_values_table.py --write",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
