"""No module of the library or of the built-in plugins writes another object's private
state: an assignment to ``x._name`` (or ``setattr(x, "_name", ...)``) has ``self`` or
``cls`` as ``x``. A step's figures come back in its outcome for its caller to count, and an
object resets its own clocks (:mod:`dloom.decode.step`, :meth:`dloom.DiffusionDecoder.session_calls`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (ROOT / "core" / "dloom", ROOT / "plugins" / "dloom_plugins")


def private_writes(source: str) -> list[str]:
    """Each statement of ``source`` that writes a private attribute of an object other than
    ``self`` or ``cls``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and str(name.value).startswith("_") and not _own(node.args[0]):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        for target in targets:
            for part in ast.walk(target):
                if (
                    isinstance(part, ast.Attribute) and part.attr.startswith("_")
                    and not part.attr.startswith("__") and not _own(part.value)
                ):
                    found.append(f"line {node.lineno}: {ast.unparse(target)}")
    return found


def _own(value: ast.expr) -> bool:
    return isinstance(value, ast.Name) and value.id in ("self", "cls")


def test_no_module_writes_another_objects_private_state():
    writes = {
        str(path.relative_to(ROOT)): found
        for package in PACKAGES for path in sorted(package.rglob("*.py"))
        if (found := private_writes(path.read_text()))
    }
    assert writes == {}


def test_the_check_catches_a_write_into_another_object():
    source = "def step(session, decoder):\n    decoder._timer = None\n    setattr(session, '_plan', [])\n    self._mine = 1\n"
    assert private_writes(source) == ["line 2: decoder._timer", "line 3: setattr(session, '_plan', [])"]
