"""The layer contracts of ``dloom`` and its built-in plugins, read from the import graph.

Contracts, not file lists: a new module anywhere passes as long as it keeps them.

* **Layers**, lowest first: the library (every module of ``dloom`` that is no front-end,
  the public API ``dloom/__init__`` and the SDK ``dloom.sdk`` included), the HTTP server
  ``dloom.serve``, scale-out ``dloom.ray`` (its Ray Serve deployment wraps the server), the
  command line ``dloom.cli`` (which mounts ``dloom serve`` and ``--ray``), and last the
  plugins (``dloom_plugins``). A module imports only modules of its own layer or lower ones.
* **Plugins through the SDK**: a plugin imports ``dloom`` only as ``dloom.sdk`` (or a module
  under it) and the top-level ``dloom``; the core names no plugin.
* **No import cycles** among ``dloom``'s modules.
* **Arrows that must never exist** (:data:`NEVER`), each with its reason.
* The library draws nothing: it imports no ``rich`` (progress and tables are the front-ends').

The graph is read from the source with :mod:`ast`, so every import counts: module-level
ones, those inside functions and ``try`` blocks, and those under ``if TYPE_CHECKING:`` (an
annotation naming a module depends on it as much as a call does). A node is a module (a
package is its ``__init__``). ``import a.b.c`` is an edge to ``a.b.c``; ``from a.b import c``
to ``a.b.c`` when that is a module, else to ``a.b``; relative imports are resolved.
Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``, but those are not edges:
every module would otherwise depend on the package's public API, the top of the graph.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "dloom"
PLUGINS = ROOT / "plugins" / "dloom_plugins"
PLUGIN_PACKAGE = "dloom_plugins"
FRONT_ENDS = {"dloom.serve": 1, "dloom.ray": 2, "dloom.cli": 3, "dloom.sdk": 4}
"""Each front-end's layer, and above them the plugin SDK (``dloom.sdk.cli`` hands plugins the
command line's helpers), which no module of the package imports; every other module of
``dloom`` is the library, layer 0."""
PLUGIN_LAYER = 5
SDK = "dloom.sdk"
"""The plugins' one way into the core, beside the top-level ``dloom``."""
DRAWING = {"rich"}
"""Packages that draw on a terminal: the front-ends' (and plugins'), never the library's."""

Edges = dict[str, dict[str, int]]


@dataclass(frozen=True)
class Arrow:
    """An import that must never exist: from a module within ``source`` to one within
    ``target`` (``exact``: to the module ``target`` itself, not those under it)."""

    source: str
    target: str
    why: str
    exact: bool = False

    def matches(self, importer: str, imported: str) -> bool:
        reaches = imported == self.target if self.exact else within(imported, self.target)
        return within(importer, self.source) and reaches


NEVER = (
    Arrow("dloom.decode", "dloom.ar", "the diffusion decoder knows no AR target: dloom.factory builds that decoder"),
    Arrow("dloom.decode", "dloom", "the decoder is part of the public API, not a user of it", exact=True),
    Arrow("dloom.metrics", "dloom.hooks", "metrics are definitions; the hook timer is dloom.hooks.timing"),
    Arrow("dloom.evaluation", "dloom.ray", "the library imports no front-end: evaluate_on_ray is dloom.ray's"),
    Arrow(PLUGIN_PACKAGE, "dloom.cli", "a plugin's command-line helpers come from dloom.sdk"),
    Arrow(PLUGIN_PACKAGE, "dloom.model.runner", "a plugin calls the model through dloom.sdk's forward protocol"),
)
"""The six arrows of issue 51 that the layers alone would allow."""


def within(module: str, scope: str) -> bool:
    return module == scope or module.startswith(scope + ".")


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` for every import in ``tree``."""
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, None, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            found.extend((base, alias.name, node.lineno) for alias in node.names)
    return sorted(found, key=lambda found: found[2])


def import_graph(roots: dict[str, Path]) -> tuple[dict[str, Path], Edges, Edges]:
    """The modules of the packages ``{name: root}``, the edges between them
    (``{importer: {imported: first line}}``) and their imports of other top-level
    packages (``{importer: {package: first line}}``)."""
    names = {n: p for package, root in roots.items() for n, p in module_names(root, package).items()}
    edges: Edges = {name: {} for name in names}
    outside: Edges = {name: {} for name in names}
    for name, path in names.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
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
    if within(module, PLUGIN_PACKAGE):
        return PLUGIN_LAYER
    for front_end, rank in FRONT_ENDS.items():
        if within(module, front_end):
            return rank
    return 0


def upward_imports(edges: Edges) -> list[str]:
    """Imports of a higher layer's module: the library reaching into a front-end, a
    front-end into a later one, the core into a plugin."""
    return [
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)}) at line {line}"
        for a, targets in sorted(edges.items()) for b, line in sorted(targets.items())
        if layer(b) > layer(a)
    ]


def plugin_imports_past_the_sdk(edges: Edges) -> list[str]:
    """A plugin's imports of a ``dloom`` module other than the top-level ``dloom`` and the SDK."""
    return [
        f"{a} imports {b} at line {line}"
        for a, targets in sorted(edges.items()) if layer(a) == PLUGIN_LAYER
        for b, line in sorted(targets.items())
        if within(b, "dloom") and b != "dloom" and not within(b, SDK)
    ]


def never_arrows(edges: Edges) -> list[str]:
    return [
        f"{a} imports {b} at line {line}: {arrow.why}"
        for arrow in NEVER
        for a, targets in sorted(edges.items()) for b, line in sorted(targets.items())
        if arrow.matches(a, b)
    ]


def library_drawing(outside: Edges) -> list[str]:
    return [
        f"{m} imports {package} at line {line}"
        for m, packages in sorted(outside.items()) if within(m, "dloom") and layer(m) == 0
        for package, line in sorted(packages.items()) if package in DRAWING
    ]


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], Edges, Edges]:
    return import_graph({"dloom": CORE, PLUGIN_PACKAGE: PLUGINS})


def test_the_graph_sees_both_packages_and_their_lazy_imports(graph):
    names, edges, _ = graph
    assert {"dloom", "dloom.cli.commands", "dloom.decode.decoder", "dloom.serve.app", "dloom_plugins.spiffy.plugin"} <= set(names)
    # `dloom eval` imports the evaluation inside its command: a lazy import is an edge
    assert "dloom.evaluation" in edges["dloom.cli.commands"]
    assert "dloom.decode.decoder" in edges["dloom"]  # a package __init__ importing its modules
    assert any(within(b, "dloom") for a, targets in edges.items() if layer(a) == PLUGIN_LAYER for b in targets)


def test_each_layer_imports_only_its_own_or_lower_ones(graph):
    _, edges, _ = graph
    assert upward_imports(edges) == []
    assert [m for m in edges["dloom"] if layer(m)] == []  # `import dloom` loads no front-end


def test_dloom_has_no_import_cycles(graph):
    _, edges, _ = graph
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(describe(c, edges) for c in found)


def test_the_never_arrows_of_the_core_are_absent(graph):
    _, edges, _ = graph
    assert [found for found in never_arrows(edges) if not found.startswith(PLUGIN_PACKAGE)] == []


@pytest.mark.skipif(not (CORE / "sdk.py").is_file() and not (CORE / "sdk").is_dir(), reason="dloom.sdk not in this tree yet")
def test_plugins_import_dloom_only_through_the_sdk(graph):
    _, edges, _ = graph
    assert plugin_imports_past_the_sdk(edges) == []
    assert [found for found in never_arrows(edges) if found.startswith(PLUGIN_PACKAGE)] == []


def test_the_library_draws_nothing(graph):
    _, _, outside = graph
    assert library_drawing(outside) == []


def test_the_core_names_no_plugin(graph):
    _, _, outside = graph
    naming = [f"{m} line {lines[PLUGIN_PACKAGE]}" for m, lines in sorted(outside.items()) if PLUGIN_PACKAGE in lines]
    assert naming == []
    texts = [p for p in CORE.rglob("*.py") if f"{PLUGIN_PACKAGE}." in p.read_text() or f'"{PLUGIN_PACKAGE}' in p.read_text()]
    allowed = {CORE / "errors.py"}  # INTERNAL_PACKAGES: tracebacks inside dloom's own packages are trimmed
    assert [str(p.relative_to(CORE)) for p in texts if p not in allowed] == []


def write_package(root: Path, package: str, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / package


def test_the_checker_reports_lazy_and_type_checking_cycles(tmp_path):
    root = write_package(tmp_path, "pkg", {
        "__init__.py": "",
        "low.py": "def f():\n    from pkg import high\n    return high\n",
        "high.py": "from . import low\n",
        "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.hints import H\n",
        "hints.py": "import pkg.typed\n",
    })
    _, edges, _ = import_graph({"pkg": root})
    found = cycles(edges)
    assert found == [["pkg.high", "pkg.low", "pkg.high"], ["pkg.hints", "pkg.typed", "pkg.hints"]]
    assert describe(found[0], edges) == "pkg.high (line 1) -> pkg.low (line 2) -> pkg.high"
    assert describe(found[1], edges) == "pkg.hints (line 1) -> pkg.typed (line 3) -> pkg.hints"


def test_the_checker_reports_planted_violations_of_every_contract(tmp_path):
    """A copy of the layout with one violation of each contract planted: each is reported,
    and the imports the contracts allow are not."""
    core = write_package(tmp_path, "dloom", {
        "__init__.py": "from dloom.decode.decoder import run\n",
        "metrics.py": "from dloom.hooks.timing import HookTimer\n",
        "evaluation.py": "import rich.progress\n",
        "sdk.py": "from dloom.decode.decoder import run\n", "errors.py": "",
        "hooks/__init__.py": "", "hooks/timing.py": "",
        "cli/__init__.py": "", "cli/commands.py": "from dloom.decode.decoder import run\n",
        "serve/__init__.py": "", "serve/app.py": "import dloom.ray.batch\n",
        "ray/__init__.py": "", "ray/batch.py": "",
        "ar/__init__.py": "", "ar/decoder.py": "",
        "model/__init__.py": "", "model/runner.py": "",
        "decode/__init__.py": "",
        "decode/decoder.py": "def run():\n    import dloom.cli.commands\n    from dloom.ar.decoder import X\n",
        "decode/oracle.py": "from dloom import hookimpl\n",
    })
    plugins = write_package(tmp_path, PLUGIN_PACKAGE, {
        "__init__.py": "",
        "good.py": "import dloom\nfrom dloom import hookimpl\nfrom dloom.sdk import run\nimport torch\n",
        "bad.py": "from dloom.cli.commands import fail\nfrom dloom.model import runner\nfrom dloom import errors\n",
    })
    _, edges, outside = import_graph({"dloom": core, PLUGIN_PACKAGE: plugins})
    assert upward_imports(edges) == [
        "dloom.decode.decoder (layer 0) imports dloom.cli.commands (layer 3) at line 2",
        "dloom.serve.app (layer 1) imports dloom.ray.batch (layer 2) at line 1",
    ]
    assert cycles(edges) == [["dloom.cli.commands", "dloom.decode.decoder", "dloom.cli.commands"]]
    assert plugin_imports_past_the_sdk(edges) == [
        "dloom_plugins.bad imports dloom.cli.commands at line 1",
        "dloom_plugins.bad imports dloom.errors at line 3",  # `from dloom import <module>` is that module
        "dloom_plugins.bad imports dloom.model.runner at line 2",
    ]
    assert [found.split(":")[0] for found in never_arrows(edges)] == [
        "dloom.decode.decoder imports dloom.ar.decoder at line 3",
        "dloom.decode.oracle imports dloom at line 1",
        "dloom.metrics imports dloom.hooks.timing at line 1",
        "dloom_plugins.bad imports dloom.cli.commands at line 1",
        "dloom_plugins.bad imports dloom.model.runner at line 2",
    ]
    assert library_drawing(outside) == ["dloom.evaluation imports rich at line 1"]


TESTS = Path(__file__).resolve().parent
TEST_FOLDERS_BEYOND_THE_PACKAGE = {"training": "the trainer", "plugins": "the built-in strategies", "fixtures": "test data"}


def test_the_tests_mirror_the_packages_with_unique_names():
    """``tests/<package>/`` tests ``dloom.<package>``; what spans packages stays in ``tests/``."""
    packages = {p.parent.name for p in CORE.glob("*/__init__.py")}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders - packages - set(TEST_FOLDERS_BEYOND_THE_PACKAGE) == set()
    # without __init__.py files pytest imports each test file by its base name: one per name
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
    assert not list(TESTS.rglob("__init__.py"))


def test_the_benchmarks_are_a_package_that_needs_no_path_edits():
    """``benchmarks`` imports as a package from the repository root (``python -m
    benchmarks.report``): every module imports by its package name, and none edits
    ``sys.path`` to find a sibling."""
    import importlib

    modules = sorted((ROOT / "benchmarks").rglob("*.py"))
    assert (ROOT / "benchmarks" / "__init__.py") in modules and len(modules) > 20
    edits = [str(p.relative_to(ROOT)) for p in modules if "sys.path" in p.read_text(encoding="utf-8")]
    assert not edits, f"benchmark modules that edit sys.path: {edits}"
    for path in modules:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        assert importlib.import_module(name).__file__ == str(path)
