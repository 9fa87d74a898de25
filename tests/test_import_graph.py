"""The shape of the ``dloom`` package: subpackages by role, no import cycles, the library
below its front-ends, and no plugin named by the core.

The graph is read from the source with :mod:`ast`, so every import counts: module-level
ones, those inside functions and ``try`` blocks, and those under ``if TYPE_CHECKING:`` (an
annotation naming a module depends on it as much as a call does). The rules:

* A node is a module (a package is its ``__init__``). ``import a.b.c`` is an edge to
  ``a.b.c``; ``from a.b import c`` to ``a.b.c`` when that is a module, else to ``a.b``;
  relative imports are resolved. Importing ``a.b.c`` also runs ``a/__init__`` and
  ``a/b/__init__``, but those are not edges: every module would otherwise depend on the
  package's public API, the top of the graph. A package ``__init__`` importing its own
  submodules is an edge like any other.
* A module-level ``__getattr__`` that raises a ``DeprecationWarning`` is a compatibility
  alias for a name that moved (PEP 562): its imports run only when an old path is used,
  never on import, and are not edges.
* Layers, lowest first: the library, then the front-ends ``dloom.serve`` (the HTTP server),
  ``dloom.ray`` (scale-out; its Ray Serve deployment wraps the HTTP server) and
  ``dloom.cli`` (the command line, which mounts ``dloom serve`` and ``--ray``). A module imports only modules of its own layer or lower ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "core" / "dloom"
FRONT_ENDS = {"dloom.serve": 1, "dloom.ray": 2, "dloom.cli": 3}
"""Each front-end's layer; every other module of ``dloom`` is the library, layer 0."""
PLUGIN_PACKAGE = "dloom_plugins"

Edges = dict[str, dict[str, int]]


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_deprecation_alias(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
        and any(isinstance(n, ast.Name) and n.id == "DeprecationWarning" for n in ast.walk(node))
    )


def imports(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` for every import but those of a
    deprecation alias."""
    found: list[tuple[str, str | None, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not (node is tree and _is_deprecation_alias(child)):
                visit_one(child)

    def visit_one(child: ast.AST) -> None:
        if isinstance(child, ast.Import):
            found.extend((alias.name, None, child.lineno) for alias in child.names)
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (child.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            found.extend((base, alias.name, child.lineno) for alias in child.names)
        visit(child)

    visit(tree)
    return found


def import_graph(root: Path, package: str) -> tuple[dict[str, Path], Edges, Edges]:
    """The package's modules, the edges between them (``{importer: {imported: line}}``) and
    the imports of other top-level packages (``{importer: {package: line}}``)."""
    names = module_names(root, package)
    edges: Edges = {name: {} for name in names}
    outside: Edges = {name: {} for name in names}
    for name, path in names.items():
        tree = ast.parse(path.read_text(), str(path))
        for base, imported, line in imports(tree, name, path.name == "__init__.py"):
            target = f"{base}.{imported}" if imported and f"{base}.{imported}" in names else base
            if target in names:
                if target != name:
                    edges[name].setdefault(target, line)
            else:
                outside[name].setdefault(target.split(".")[0], line)
    return names, edges, outside


def cycles(edges: Edges) -> list[list[str]]:
    """The strongly connected components of more than one module, each as one cycle through
    it (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(edges[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(_cycle_through(sorted(component), edges))
    return components


def _cycle_through(component: list[str], edges: Edges) -> list[str]:
    """One cycle from the component's first module back to it, within the component."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(edges[node]):
                if successor == start:
                    return paths[node] + [start]
                if successor in members and successor not in paths:
                    paths[successor] = paths[node] + [successor]
                    following.append(successor)
        frontier = following
    raise AssertionError(f"{component} is no cycle")


def describe(cycle: list[str], edges: Edges) -> str:
    return " -> ".join(
        f"{a} (line {edges[a][b]})" for a, b in zip(cycle, cycle[1:])
    ) + f" -> {cycle[-1]}"


def layer(module: str) -> int:
    for front_end, rank in FRONT_ENDS.items():
        if module == front_end or module.startswith(front_end + "."):
            return rank
    return 0


def upward_imports(edges: Edges) -> list[str]:
    """Imports of a higher layer's module: the library reaching into a front-end."""
    return [
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)}) at line {line}"
        for a, targets in sorted(edges.items()) for b, line in sorted(targets.items())
        if layer(b) > layer(a)
    ]


SUBPACKAGES = {
    "hooks": {"specs", "calls", "registry", "composition", "cache_policies"},
    "model": {"adapter", "runner", "cache_policy", "profiles", "checkpoints", "files", "attention", "tensor_check",
              "config_limits", "json_files"},
    "decode": {"decoder", "decoders", "session", "kernel", "speculation", "generation", "prompts",
               "commit", "logprobs", "batching", "oracle", "step"},
    "ar": {"target", "decoder", "result", "chains"},
    "cli": {"commands", "exits", "plugins"},
}
"""The library's subpackages by role and the command line, with their modules."""
TOP_LEVEL = {"__init__", "types", "errors", "metrics", "factory", "evaluation", "startup", "old_paths"}
"""The only modules directly in ``dloom/``: the public API and what every role shares."""


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], Edges, Edges]:
    return import_graph(CORE, "dloom")


def test_the_graph_sees_the_package_and_its_lazy_imports(graph):
    names, edges, _ = graph
    assert {"dloom", "dloom.cli", "dloom.cli.commands", "dloom.decode.decoder", "dloom.serve.app",
            "dloom.check.bounds"} <= set(names)
    # `dloom eval` imports the evaluation inside its command: a lazy import is an edge
    assert "dloom.evaluation" in edges["dloom.cli.commands"]
    assert "dloom.decode.decoder" in edges["dloom"]  # a package __init__ importing its modules


def test_the_package_is_laid_out_by_role():
    packages = {p.parent.name for p in CORE.glob("*/__init__.py")}
    assert packages == {*SUBPACKAGES, "check", "zoo", "serve", "ray"}
    assert {p.stem for p in CORE.glob("*.py")} == TOP_LEVEL
    for package, modules in SUBPACKAGES.items():
        assert {p.stem for p in (CORE / package).glob("*.py")} == {"__init__", *modules}, package


TESTS = Path(__file__).resolve().parent
TEST_FOLDERS = {"hooks", "model", "decode", "cli", "serve", "ray", "check", "zoo", "training", "plugins"}
"""``tests/`` mirrors the packages: ``tests/decode/`` tests ``dloom.decode`` (``training/``
the trainer, ``plugins/`` the built-in strategies); what spans them stays in ``tests/``."""


def test_the_tests_mirror_the_packages_with_unique_names():
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name not in {"fixtures", "__pycache__"}}
    assert folders == TEST_FOLDERS
    assert folders - {"training", "plugins"} <= {*SUBPACKAGES, "check", "zoo", "serve", "ray"}
    # without __init__.py files pytest imports each test file by its base name: one per name
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
    assert not list(TESTS.rglob("__init__.py"))


def test_the_startup_handler_is_library_and_the_cli_a_front_end(graph):
    _, edges, _ = graph
    assert "dloom.startup" in edges["dloom"] and layer("dloom.startup") == 0
    assert all(layer(m) == 3 for m in edges if m.startswith("dloom.cli"))
    assert [m for m in edges["dloom"] if layer(m)] == []  # `import dloom` loads no front-end


def test_dloom_has_no_import_cycles(graph):
    _, edges, _ = graph
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(describe(c, edges) for c in found)


def test_the_library_imports_no_front_end(graph):
    _, edges, _ = graph
    assert upward_imports(edges) == []


def test_the_core_names_no_plugin(graph):
    _, _, outside = graph
    naming = [f"{m} line {lines[PLUGIN_PACKAGE]}" for m, lines in sorted(outside.items()) if PLUGIN_PACKAGE in lines]
    assert naming == []
    texts = [p for p in CORE.rglob("*.py") if f"{PLUGIN_PACKAGE}." in p.read_text() or f'"{PLUGIN_PACKAGE}' in p.read_text()]
    allowed = {CORE / "errors.py"}  # INTERNAL_PACKAGES: tracebacks inside dloom's own packages are trimmed
    assert [str(p.relative_to(CORE)) for p in texts if p not in allowed] == []


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_checker_reports_lazy_and_type_checking_cycles_and_skips_aliases(tmp_path):
    root = write_package(tmp_path, {
        "__init__.py": "",
        "low.py": "def f():\n    from pkg import high\n    return high\n",
        "high.py": "from . import low\n",
        "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.hints import H\n",
        "hints.py": "import pkg.typed\n",
        "moved.py": (
            "import warnings\n"
            "def __getattr__(name):\n"
            "    warnings.warn('moved', DeprecationWarning)\n"
            "    from pkg.user import thing\n"
            "    return thing\n"
        ),
        "user.py": "from pkg.moved import other\n",
    })
    _, edges, _ = import_graph(root, "pkg")
    found = cycles(edges)
    assert found == [["pkg.high", "pkg.low", "pkg.high"], ["pkg.hints", "pkg.typed", "pkg.hints"]]
    assert describe(found[0], edges) == "pkg.high (line 1) -> pkg.low (line 2) -> pkg.high"
    assert describe(found[1], edges) == "pkg.hints (line 1) -> pkg.typed (line 3) -> pkg.hints"
    assert "pkg.user" not in edges["pkg.moved"]  # the alias's import runs only on the old name


def test_the_checker_reports_a_library_module_importing_a_front_end(tmp_path):
    root = write_package(tmp_path, {
        "__init__.py": "", "cli/__init__.py": "", "cli/commands.py": "from dloom.decode.decoder import run\n",
        "decode/__init__.py": "", "decode/decoder.py": "def run():\n    import dloom.cli.commands\n",
    })
    _, edges, _ = import_graph(root, "dloom")
    assert upward_imports(edges) == ["dloom.decode.decoder (layer 0) imports dloom.cli.commands (layer 3) at line 2"]
    assert cycles(edges) == [["dloom.cli.commands", "dloom.decode.decoder", "dloom.cli.commands"]]


def test_the_benchmarks_are_a_package_that_needs_no_path_edits():
    """``benchmarks`` imports as a package from the repository root (``python -m
    benchmarks.report``): every module imports by its package name, and none edits
    ``sys.path`` to find a sibling."""
    import importlib

    root = CORE.parents[1]
    modules = sorted((root / "benchmarks").rglob("*.py"))
    assert (root / "benchmarks" / "__init__.py") in modules and len(modules) > 20
    edits = [str(p.relative_to(root)) for p in modules if "sys.path" in p.read_text(encoding="utf-8")]
    assert not edits, f"benchmark modules that edit sys.path: {edits}"
    for path in modules:
        name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        assert importlib.import_module(name).__file__ == str(path)
