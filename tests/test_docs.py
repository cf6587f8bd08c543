"""The docs agree with the code (issue #70): relative links resolve, every policy is in the policy
docs, generated tables have a currency check, README and docs/results keep their size, and every
``vllm-kvcomp`` example in the docs and in the CLI's help parses with the real parser (the cheap
ones run). Nothing here starts a server or loads a model."""

from __future__ import annotations

import ast
import importlib
import re
import shlex
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_kvcomp import bench, cli
from vllm_kvcomp.bench import common
from vllm_kvcomp.models import MODEL_NAME, SOURCES
from vllm_kvcomp.policies.registry import policy_names

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
CELL_MAX_CHARS = 400
RESULTS_MAX_ENTRIES = 30
CHOOSING = "## Choosing a policy"
#: every generated block (its marker name) -> the file that holds it and the test keeping it current
GENERATED = {
    "quality-table": ("README.md", "tests/eval/test_quality_table.py", "test_readme_table_matches_the_results"),
    "policy-table": ("docs/policies.md", "tests/eval/test_policy_table.py",
                     "test_policies_doc_table_matches_the_registry"),
    "values-table": ("deploy/helm/vllm-kvcomp/README.md", "tests/deploy/test_helm_chart.py",
                     "test_readme_values_table_is_current"),
    "gpu-backend-table": ("docs/compatibility.md", "tests/engine/test_backend_choice.py", "test_the_table_is_current"),
}
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
HTML_TARGET = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)=["']([^"']+)["']""")
HTML_ANCHOR = re.compile(r"""<a\b[^>]*?\b(?:name|id)=["']([^"']+)["']""")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
COMMAND = re.compile(r"^(?:\$\s+)?(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*vllm-kvcomp(?:\s|$)")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]{2,}$")  # NAME, PATH: a synopsis, not an example
STANDS_FOR = {"MODEL": MODEL_NAME}  # placeholders any real value fills: checked with this one
#: the examples the test runs, not only parses (with any ``--help``): listings, which touch nothing
LISTINGS = (["bench", "--list"], ["model", "list"])


def doc_files() -> list[Path]:
    """The documents the issue holds to these rules (CHANGELOG.md whether or not it exists yet)."""
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "docs" / "results").rglob("*.md")), *sorted((ROOT / "deploy").rglob("README.md"))]


def current_docs() -> list[Path]:
    """:func:`doc_files` that exist, less docs/results/archive/ (superseded runs kept verbatim)."""
    archive = ROOT / "docs" / "results" / "archive"
    return [doc for doc in doc_files() if doc.exists() and archive not in doc.parents]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---------------------------------------------------------------------------- markdown


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        found = FENCE.match(line)
        if found and (fence is None or found.group(1) == fence):
            fence = found.group(1) if fence is None else None
        elif fence is None:
            out.append((number, line))
    return out


def fenced_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) inside fenced code blocks."""
    outside = {number for number, _ in prose_lines(text)}
    return [(n, line) for n, line in enumerate(text.splitlines(), 1)
            if n not in outside and not FENCE.match(line)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped, lower case, punctuation removed,
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a link into ``path`` may name: its headings' slugs (repeats get -1, -2, ...)
    and explicit ``<a name|id>``."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        out.update(HTML_ANCHOR.findall(line))
        found = HEADING.match(line)
        if found:
            base = slug(found.group(2))
            count = seen.get(base, 0)
            out.add(base if count == 0 else f"{base}-{count}")
            seen[base] = count + 1
    return out


def link_targets(text: str) -> list[tuple[int, str]]:
    """(line, target) of every markdown, reference-style and HTML link outside code."""
    out = []
    for number, line in prose_lines(text):
        line = CODE_SPAN.sub("", line)
        for pattern in (LINK, REFERENCE, HTML_TARGET):
            out.extend((number, target) for target in pattern.findall(line))
    return out


def broken_link(source: Path, target: str, root: Path = ROOT) -> str | None:
    """Why ``target`` (a link in ``source``) does not resolve, or None; external links pass."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//", target):
        return None
    path_part, _, anchor = urllib.parse.unquote(target).partition("#")
    if not path_part:
        resolved = source
    elif path_part.startswith("/"):
        resolved = root / path_part.lstrip("/")
    else:
        resolved = (source.parent / path_part).resolve()
    if root not in (resolved, *resolved.parents):
        return "points outside the repository"
    if not resolved.exists():
        return "no such file"
    if anchor and resolved.suffix == ".md" and anchor.lower() not in anchors(resolved):
        return f"{resolved.relative_to(root)} has no heading for #{anchor}"
    return None


def table_cells(text: str) -> list[tuple[int, str]]:
    """(line, cell) of every markdown table row outside code (``\\|`` does not split a cell)."""
    return [(number, cell.strip()) for number, line in prose_lines(text) if line.lstrip().startswith("|")
            for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def section(text: str, heading: str) -> str | None:
    """The lines under ``heading`` up to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = [line for _, line in prose_lines(text)]
    if heading not in (line.rstrip() for line in lines):
        return None
    start = [line.rstrip() for line in lines].index(heading) + 1
    end = next((i for i in range(start, len(lines)) if (m := HEADING.match(lines[i])) and len(m.group(1)) <= level),
               len(lines))
    return "\n".join(lines[start:end])


def names_in_code(text: str, names: tuple[str, ...]) -> set[str]:
    """The ``names`` that appear as a word inside some code span of ``text``."""
    spans = [m.group(2) for m in CODE_SPAN.finditer(text)]
    return {name for name in names if any(re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", s) for s in spans)}


# ---------------------------------------------------------------------------- CLI examples


@dataclass(frozen=True)
class Example:
    """One ``vllm-kvcomp ...`` command found in a document or a help text."""

    where: str
    text: str
    inline: bool = False  # a code span in prose, where ``vllm-kvcomp NAME`` alone names the command

    @property
    def argv(self) -> list[str]:
        """The arguments after ``vllm-kvcomp`` (a ``$`` prompt, ``VAR=value`` prefixes and a trailing
        ``# comment`` dropped)."""
        words = shlex.split(self.text, comments=True)
        words = words[1:] if words[:1] == ["$"] else words
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words = words[1:]
        assert words[:1] == ["vllm-kvcomp"], self.text
        return [STANDS_FOR.get(w, w) for w in words[1:]]

    @property
    def synopsis(self) -> bool:
        """A usage form (``[MODEL]``, ``a|b``, ``NAME``, ``...``), not a command to run."""
        return any(w.startswith("[") or "|" in w or w in ("...", "…") or PLACEHOLDER.match(w) for w in self.argv)


def cli_examples(text: str, where: str, *, markdown: bool) -> list[Example]:
    """Every ``vllm-kvcomp`` command in ``text``: in markdown, the lines of fenced blocks and the
    code spans that start with it; in a help text, the lines that start with it. Lines ending in
    ``\\`` continue on the next."""
    if markdown:
        lines = fenced_lines(text)
        spans = [(n, m.group(2).strip()) for n, line in prose_lines(text) for m in CODE_SPAN.finditer(line)]
    else:
        lines, spans = list(enumerate(text.splitlines(), 1)), []
    out, joined, first = [], "", 0
    for number, line in lines:
        first = first or number
        joined += line.strip()
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        if COMMAND.match(joined):
            out.append(Example(f"{where}:{first}", joined))
        joined, first = "", 0
    out += [Example(f"{where}:{n}", span, inline=True) for n, span in spans if COMMAND.match(span)]
    return out


def serve_parser():
    from vllm_kvcomp.server.cli import build_parser

    return build_parser()[0]  # a fresh one each time: vLLM's parser remembers a --help=TOPIC


def parser_for(argv: list[str]):
    """The real parser of the subcommand ``argv`` names, and the arguments it parses."""
    name, rest = argv[0], argv[1:]
    if name == "serve":
        return serve_parser(), rest
    if name == "bench":
        benchmark, rest = bench.select(rest)
        module = importlib.import_module(bench.BENCHMARKS[benchmark][0])
        return common.build_parser(module, benchmark, f"{bench.PROG} {benchmark}"), rest
    return cli.subcommand_parser(name), rest


def option_strings(argv: list[str]) -> set[str]:
    """Every option a synopsis's subcommand takes: of its benchmark if it names one (else of every
    benchmark), of every action (``model fetch``...)."""
    if argv[0] not in cli.SUBCOMMANDS:
        parsers = [cli._top_parser()]
    elif argv[0] == "bench":
        names = argv[1:2] if argv[1:2] and argv[1] in bench.BENCHMARKS else list(bench.BENCHMARKS)
        parsers = [parser_for(["bench", name])[0] for name in names]
    else:
        parsers = [parser_for(argv[:1])[0]]
    options: set[str] = set()
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            options.update(action.option_strings)
            if isinstance(action.choices, dict):  # subparsers
                parsers.extend(action.choices.values())
    return options


def model_problem(model: str | None, *, folder_only: bool = False) -> str | None:
    """A model argument that would not be found: neither fetchable (where the command fetches) nor
    a folder or hub id."""
    if model is None or "/" in model or (model in SOURCES and not folder_only):
        return None
    if folder_only:
        return f"model {model!r}: this command takes a folder (`vllm-kvcomp model path NAME` prints one)"
    return f"model {model!r} is neither a fetchable name ({', '.join(SOURCES)}) nor a folder / hub id"


def check_example(example: Example) -> str | None:
    """Why ``example`` would not run as written (None if it would): its subcommand, a dry parse by
    the real parser (vLLM's for ``serve``), the values the server or harness checks first (model,
    policies, tasks, operator config); a cheap one (help, listing) runs."""
    try:
        argv = example.argv
    except ValueError as err:
        return f"not a shell command: {err}"
    if not argv or (argv[0] not in cli.SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        return f"no such subcommand: {argv[:1]}"
    if example.inline and len(argv) == 1:
        return None  # names the subcommand, as checked above
    if example.synopsis:
        unknown = {w.split("=")[0] for w in argv if w.startswith("--")} - option_strings(argv)
        return f"no such option(s): {sorted(unknown)}" if unknown else None
    if argv[:2] in LISTINGS or any(w in ("-h", "--help") or w.startswith("--help=") for w in argv):
        return run_cheap(argv)
    parser, rest = parser_for(argv)
    try:
        args = parser.parse_args(rest)
    except SystemExit as done:
        return f"the parser refused it (exit {done.code})"
    given = {w.split("=")[0] for w in rest if w.startswith("--")}
    model = getattr(args, "model_tag", None) or getattr(args, "model", None)
    return (model_problem(model, folder_only=argv[0] == "calibrate")
            or (config_problem(args.kv_compression_config) if "--kv-compression-config" in given else None)
            or (eval_problem(args) if argv[0] == "eval" else None)
            or (policies_problem(args.policies) if argv[0] == "bench" and "--policies" in given else None))


def run_cheap(argv: list[str]) -> str | None:
    """Run a help or listing; serve's help through its parser (its ``main`` sets up vLLM's process)."""
    try:
        code = serve_parser().parse_args(argv[1:]) if argv[0] == "serve" else cli.main(argv)
    except SystemExit as done:
        code = done.code
    return None if code in (0, None) else f"exited {code}"


def config_problem(path: str) -> str | None:
    from vllm_kvcomp.server.operator_config import ConfigError, OperatorConfig

    local = ROOT / path.removeprefix("/opt/vllm-kvcomp/")  # the images' copy of the repository's configs/
    try:
        OperatorConfig.load(local)
    except ConfigError as err:
        return f"--kv-compression-config {path}: {err}"
    return None


def policies_problem(text: str) -> str | None:
    """A benchmark's ``--policies``: every label starts with a registered policy."""
    unknown = [p for p in text.split(",") if re.split(r"[: ]", p.strip())[0] not in (*policy_names(), "none", "all")]
    return f"unknown policies {unknown}" if unknown else None


def eval_problem(args) -> str | None:
    """What ``vllm-kvcomp eval`` checks before sending a request: conditions, tasks, lengths."""
    from vllm_kvcomp.eval import runner
    from vllm_kvcomp.eval.cli import parse_length
    from vllm_kvcomp.eval.tasks import TASKS

    if not args.report_only and not (args.url and args.model):
        return "--url and --model are required (or --report-only)"
    try:
        runner.conditions(args.policies.split(","), [float(r) for r in args.ratios.split(",")], args.scope)
        for length in args.lengths.split(","):
            parse_length(length)
    except ValueError as err:
        return str(err)
    unknown = set(args.tasks.split(",")) - set(TASKS)
    return f"unknown tasks {sorted(unknown)}" if unknown else None


def help_texts() -> dict[str, str]:
    """``vllm-kvcomp [COMMAND] --help`` of the dispatcher and every subcommand."""
    texts = {"vllm-kvcomp --help": cli._top_parser().format_help(), "vllm-kvcomp bench --help": bench.usage(),
             "vllm-kvcomp serve --help": serve_parser().format_help()}
    for name in set(cli.SUBCOMMANDS) - set(cli.RAW_ARGV):
        texts[f"vllm-kvcomp {name} --help"] = cli.subcommand_parser(name).format_help()
    return texts


def doc_examples() -> list[Example]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [e for doc in docs for e in cli_examples(doc.read_text(encoding="utf-8"), rel(doc), markdown=True)]


# ---------------------------------------------------------------------------- tests


def test_relative_links_resolve() -> None:
    broken = []
    for doc in doc_files():
        if not doc.exists():
            broken.append(f"{rel(doc)}: missing")
            continue
        for number, target in link_targets(doc.read_text(encoding="utf-8")):
            why = broken_link(doc, target)
            if why:
                broken.append(f"{rel(doc)}:{number}: ({target}) {why}")
    assert not broken, f"{len(broken)} dead relative links:\n" + "\n".join(broken)


def test_every_policy_is_in_the_choosing_table_and_the_policies_doc() -> None:
    choosing = section((ROOT / "README.md").read_text(encoding="utf-8"), CHOOSING)
    assert choosing is not None, f"README.md has no '{CHOOSING}' section"
    policies_doc = (ROOT / "docs" / "policies.md").read_text(encoding="utf-8")
    names = policy_names()
    assert not set(names) - names_in_code(choosing, names), f"README.md '{CHOOSING}' lacks (in backticks): " \
        f"{sorted(set(names) - names_in_code(choosing, names))}"
    assert not set(names) - names_in_code(policies_doc, names), "docs/policies.md lacks (in backticks): " \
        f"{sorted(set(names) - names_in_code(policies_doc, names))}"


def test_every_generated_block_has_a_currency_test() -> None:
    """A generated table is compared with its generator by the test :data:`GENERATED` names (not run
    twice here); a new kind of generated block needs an entry there."""
    found = {}
    for doc in current_docs():
        text = doc.read_text(encoding="utf-8")
        for name in re.findall(r"<!-- ([\w-]+):start \(generated", text):
            assert f"<!-- {name}:end -->" in text, f"{rel(doc)}: {name} has no end marker"
            found.setdefault(name, []).append(rel(doc))
    assert set(found) >= set(GENERATED), f"generated blocks gone: {sorted(set(GENERATED) - set(found))}"
    for name, docs in found.items():
        assert name in GENERATED, f"{docs}: generated block {name!r} has no currency test in GENERATED"
        doc, test_file, test_name = GENERATED[name]
        assert docs == [doc], f"{name} is in {docs}; its test checks {doc}"
        tree = ast.parse((ROOT / test_file).read_text(encoding="utf-8"))
        assert test_name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, f"{test_file}::{test_name}"


def test_readme_is_short() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES, f"README.md has {len(readme.splitlines())} lines"


def test_no_table_cell_over_400_characters() -> None:
    long_cells = [f"{rel(doc)}:{n}: {len(cell)} chars: {cell[:60]}..." for doc in current_docs()
                  for n, cell in table_cells(doc.read_text(encoding="utf-8")) if len(cell) > CELL_MAX_CHARS]
    assert not long_cells, f"table cells over {CELL_MAX_CHARS} characters:\n" + "\n".join(long_cells)


def test_results_hold_one_current_file_per_benchmark() -> None:
    entries = sorted(p.name for p in (ROOT / "docs" / "results").iterdir() if p.name != "archive")
    assert len(entries) <= RESULTS_MAX_ENTRIES, f"docs/results has {len(entries)} entries: {entries}"


def test_every_doc_example_runs_as_written() -> None:
    examples = doc_examples()
    assert examples, "no vllm-kvcomp example found in README.md or docs/*.md"
    bad = [f"{e.where}: {e.text}\n    {why}" for e in examples if (why := check_example(e))]
    assert not bad, f"{len(bad)} of {len(examples)} examples would not run:\n" + "\n".join(bad)


def test_every_help_example_runs_as_written() -> None:
    texts = help_texts()
    without = [where for where, text in texts.items() if not cli_examples(text, where, markdown=False)]
    assert not without, f"help without examples: {without}"
    examples = [e for where, text in texts.items() for e in cli_examples(text, where, markdown=False)]
    bad = [f"{e.where}: {e.text}\n    {why}" for e in examples if (why := check_example(e))]
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------- the checks themselves


def test_slugs_follow_github() -> None:
    assert slug("Choosing a policy") == "choosing-a-policy"
    assert slug("`expected_attention`: Expected Attention (kvpress)") == "expected_attention-expected-attention-kvpress"
    assert slug("Results at a glance (2K, H100/H200)") == "results-at-a-glance-2k-h100h200"
    assert slug("[docs](x.md) & more") == "docs--more"


def test_link_checker_finds_dead_links_and_anchors(tmp_path) -> None:
    (tmp_path / "a.md").write_text("# Top\n## Same\n## Same\n<a id=\"here\"></a>\n")
    doc = tmp_path / "b.md"
    text = ("[ok](a.md#same-1) [gone](nope.md) ![img](a.md) [bad](a.md#missing) [web](https://x.org/y)\n"
            "`[code](nope.md)`\n```\n[fenced](nope.md)\n```\n[ref]: a.md#here\n[self](#local)\n# Local\n")
    doc.write_text(text)
    found = {target: broken_link(doc, target, tmp_path) for _, target in link_targets(text)}
    assert found == {"a.md#same-1": None, "nope.md": "no such file", "a.md": None,
                     "a.md#missing": "a.md has no heading for #missing", "https://x.org/y": None,
                     "a.md#here": None, "#local": None}


def test_example_extraction_and_synopses() -> None:
    text = ("Run `vllm-kvcomp model list` or `vllm-kvcomp bench NAME`.\n```bash\n"
            "$ vllm-kvcomp serve --port 8000   # comment\nVAR='a|b' vllm-kvcomp eval --url u \\\n"
            "    --model m\n# vllm-kvcomp not this\necho vllm-kvcomp neither\n```\n")
    examples = cli_examples(text, "t.md", markdown=True)
    assert [(e.where, e.argv, e.synopsis) for e in examples] == [
        ("t.md:3", ["serve", "--port", "8000"], False),
        ("t.md:4", ["eval", "--url", "u", "--model", "m"], False),
        ("t.md:1", ["model", "list"], False),
        ("t.md:1", ["bench", "NAME"], True),
    ]
    assert [e.inline for e in examples] == [False, False, True, True]


@pytest.mark.parametrize(("text", "problem"), [
    ("vllm-kvcomp model list", None),
    ("vllm-kvcomp bench --list", None),
    ("vllm-kvcomp nope", "no such subcommand"),
    ("vllm-kvcomp model fetch nope", "refused"),
    ("vllm-kvcomp calibrate --kind razor|pod --nope", "no such option(s): ['--nope']"),
    ("vllm-kvcomp eval --url http://localhost:8000 --model smollm2", "neither a fetchable name"),
    ("vllm-kvcomp eval --url u --model SmolLM2-135M-Instruct --policies full,nope", "unknown policy"),
    ("vllm-kvcomp eval --url u --model SmolLM2-135M-Instruct --tasks niah,nope", "unknown tasks ['nope']"),
    ("vllm-kvcomp bench kept --policies snapkv,nope", "unknown policies ['nope']"),
    ("vllm-kvcomp bench kept --nope", "refused"),
    ("vllm-kvcomp bench NAME --out x.md", None),
    ("vllm-kvcomp bench NAME --nope", "no such option(s): ['--nope']"),
    ("vllm-kvcomp model fetch [NAME] --quiet", None),
    ("vllm-kvcomp calibrate --model gemma-3-270m", "takes a folder"),
    ("vllm-kvcomp eval --model SmolLM2-135M-Instruct", "--url and --model are required"),
    ("vllm-kvcomp eval", "--url and --model are required"),
])
def test_check_example_catches_what_would_not_run(text, problem, capsys) -> None:
    why = check_example(Example("t", text))
    assert why is None if problem is None else problem in why, why


def test_a_command_named_in_prose_is_not_run() -> None:
    assert check_example(Example("t", "vllm-kvcomp eval", inline=True)) is None
    assert "no such subcommand" in check_example(Example("t", "vllm-kvcomp evaluate", inline=True))
    assert "required" in check_example(Example("t", "vllm-kvcomp eval --samples 3", inline=True))


def test_serve_examples_are_checked_by_vllms_parser() -> None:
    assert check_example(Example("t", "vllm-kvcomp serve gemma-3-270m --max-model-len 4096 "
                                      "--kv-compression-config configs/lagkv.yaml")) is None
    assert "refused" in check_example(Example("t", "vllm-kvcomp serve --max-model-len lots"))
    assert "refused" in check_example(Example("t", "vllm-kvcomp serve --no-such-vllm-flag 1"))
    assert "cannot read" in check_example(Example("t", "vllm-kvcomp serve --kv-compression-config configs/no.yaml"))
