"""The package's shape, checked from the source: import direction, the vLLM ledger, size limits.

Imports are read from the AST of every module, package ``__init__``s included. Function-level
imports count (a lazy import cannot hide a cycle) and so do ``if TYPE_CHECKING:`` imports (a cycle
through annotations is still a cycle between the modules' layers). ``from pkg import name``
depends on ``pkg``'s own body (it runs, and ``name`` is looked up in its namespace first) and, when
``pkg.name`` is a module, on that module too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_kvcomp"
COMPAT = "vllm_kvcomp.vllm_compat"
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node except those inside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _imports(module: str, source: str | None = None) -> set[str]:
    """Absolute names ``module`` imports (``from a import b`` gives ``a`` and ``a.b``); ``source``
    replaces the module's file (to test the reader)."""
    path = MODULES.get(module)
    tree = ast.parse(source if source is not None else path.read_text())
    package = module if path is not None and path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def _internal_graph() -> dict[str, set[str]]:
    return {m: {n for n in _imports(m) if n in MODULES and n != m} for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_cycle_detector_finds_a_planted_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_import_reader_counts_package_bodies_lazy_and_type_only_imports() -> None:
    source = ("from vllm_kvcomp import vllm_compat\n"
              "from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from vllm_kvcomp.eval.report import Row\n"
              "def f():\n    from . import cells\n")
    found = _imports("vllm_kvcomp.eval.claims", source) & set(MODULES)
    assert found == {"vllm_kvcomp", "vllm_kvcomp.vllm_compat", "vllm_kvcomp.eval.report",
                     "vllm_kvcomp.eval", "vllm_kvcomp.eval.cells"}


#: Cycles that need a change outside the files this test's owners edit: the root ``register``
#: (the ``vllm.general_plugins`` entry point) imports engine.plugin, which reads ``vllm_compat``
#: from the root package's namespace (``from vllm_kvcomp import vllm_compat``). ``import
#: vllm_kvcomp.vllm_compat as vllm_compat`` in engine/plugin.py ends it; then empty this list.
PENDING_CYCLES: list[list[str]] = []


def test_no_import_cycles() -> None:
    assert _cycles(_internal_graph()) == PENDING_CYCLES


def test_engine_never_imports_the_server() -> None:
    bad = {
        (m, n)
        for m, deps in _internal_graph().items()
        if m.startswith("vllm_kvcomp.engine")
        for n in deps
        if n.startswith("vllm_kvcomp.server")
    }
    assert bad == set()


def _private_vllm_uses(module: str) -> list[str]:
    """``vllm.v1`` / ``vllm._*`` imports and ``X._name`` pokes outside ``self``/``cls``."""
    tree = ast.parse(MODULES[module].read_text())
    found = []
    for node in _runtime_nodes(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        for name in names:
            parts = name.split(".")
            if parts[0] == "vllm" and (parts[1:2] == ["v1"] or any(p.startswith("_") for p in parts[1:])):
                found.append(f"{module}:{node.lineno} import {name}")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    return found


def test_private_vllm_names_only_in_vllm_compat() -> None:
    # transformers' config attribute is not vLLM's (calibration and oracle select HF attention)
    allowed = {"model.config._attn_implementation"}
    found = [
        use
        for m in MODULES
        if m != COMPAT
        for use in _private_vllm_uses(m)
        if use.split(" ", 1)[-1] not in allowed
    ]
    assert found == []


def test_every_ledgered_vllm_name_exists() -> None:
    """An upgrade of vLLM that moves or renames a private name fails here, in one place."""
    pytest.importorskip("vllm")
    from vllm_kvcomp import vllm_compat

    missing = [f"{entry.symbol}: {err}" for entry in vllm_compat.LEDGER if (err := entry.check()) is not None]
    assert missing == []
    assert {entry.symbol for entry in vllm_compat.LEDGER} >= set(vllm_compat.LAZY.values())


def test_no_function_is_longer_than_the_limit() -> None:
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name}: {length} lines")
    assert long == []


# ---------------------------------------------------------------------------- test markers

TESTS = PACKAGE.parent / "tests"
#: what starts a vLLM engine or the server in a test module: a test taking one of these session
#: fixtures, or a call to one of these imported names (its own fixture or test makes it)
STARTERS = {
    "engine": ({"engine"}, {("tests.engine.stream_engine", "run_engine"), ("vllm", "LLM")}),
    "server": ({"server"}, {("tests.server.conftest", "serving")}),
}


def _module_marks(tree: ast.Module) -> set[str]:
    """The ``pytest.mark.X`` names of a module's ``pytestmark``; ``server`` implies ``engine``."""
    marks: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            marks |= {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute)} - {"mark"}
    return marks | ({"engine"} if "server" in marks else set())


def _starts(tree: ast.Module) -> set[str]:
    """Which of engine / server a test module starts (by :data:`STARTERS`)."""
    imported = {alias.asname or alias.name: (n.module, alias.name) for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) for alias in n.names}
    called = {imported.get(n.func.id) for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    taken = {a.arg for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
             for a in n.args.args}
    return {kind for kind, (fixtures, calls) in STARTERS.items() if taken & fixtures or called & calls}


def test_marker_reader_sees_fixtures_calls_and_marks() -> None:
    tree = ast.parse("import pytest\nfrom tests.engine.stream_engine import run_engine\n"
                     "pytestmark = [pytest.mark.server]\n"
                     "@pytest.fixture\ndef runs():\n    return run_engine(1)\n"
                     "def test_a(server):\n    pass\n")
    assert _starts(tree) == {"engine", "server"} and _module_marks(tree) == {"engine", "server"}
    stub = ast.parse("async def run_engine():\n    pass\ndef test_b():\n    run_engine()\n")
    assert _starts(stub) == set() and _module_marks(stub) == set()


def test_modules_that_start_an_engine_or_a_server_are_marked() -> None:
    """So ``pytest -m "not engine and not server"`` is the fast unit run."""
    unmarked = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        missing = _starts(tree) - _module_marks(tree)
        if missing:
            unmarked[str(path.relative_to(TESTS))] = sorted(missing)
    assert unmarked == {}
