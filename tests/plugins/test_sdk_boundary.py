"""The built-in plugins reach the core only through the SDK: ``dloom.sdk`` (and its
submodules) and the top-level API (the names of ``dloom.__all__``).

Read from the source with :mod:`ast`, so every import counts: module-level ones, those
inside functions and under ``if TYPE_CHECKING:``, and attribute paths such as
``dloom.decode.kernel.KernelStep`` after ``import dloom``.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import dloom
import dloom.sdk

PLUGINS = Path(__file__).resolve().parents[2] / "plugins" / "dloom_plugins"
SDK_MODULES = ("dloom.sdk", "dloom.sdk.cli", "dloom.sdk.zoo")


def _is_sdk(module: str) -> bool:
    return module == "dloom.sdk" or module.startswith("dloom.sdk.")


def core_reaches(source: str, filename: str = "<source>") -> list[str]:
    """Each place ``source`` reaches the core other than through the SDK or the top-level
    API, as ``"line N: what"``."""
    tree = ast.parse(source, filename)
    public = set(dloom.__all__)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                f"line {node.lineno}: import {alias.name}" for alias in node.names
                if alias.name.startswith("dloom.") and not _is_sdk(alias.name)
            ]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "dloom":
                found += [
                    f"line {node.lineno}: from dloom import {alias.name}" for alias in node.names
                    if alias.name not in public and alias.name != "sdk"
                ]
            elif node.module.startswith("dloom.") and not _is_sdk(node.module):
                found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "dloom":
            if node.attr not in public and node.attr != "sdk":
                found.append(f"line {node.lineno}: dloom.{node.attr}")
    return found


def test_the_built_in_plugins_import_only_the_sdk():
    modules = sorted(PLUGINS.rglob("*.py"))
    assert len(modules) > 10 and PLUGINS / "failfast" / "drafter.py" in modules
    breaches = [
        f"{path.relative_to(PLUGINS.parent)} {where}"
        for path in modules for where in core_reaches(path.read_text(), str(path))
    ]
    assert breaches == [], "built-in plugins reaching past dloom.sdk:\n" + "\n".join(breaches)


@pytest.mark.parametrize(("source", "expected"), [
    ("from dloom.decode.kernel import KernelStep\n", ["line 1: from dloom.decode.kernel import ..."]),
    ("def f():\n    import dloom.model.runner\n", ["line 2: import dloom.model.runner"]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dloom.cli.commands import fail\n",
     ["line 3: from dloom.cli.commands import ..."]),
    ("from dloom import zoo\n", ["line 1: from dloom import zoo"]),
    ("import dloom\nstep = dloom.decode.kernel.KernelStep\n", ["line 2: dloom.decode"]),
])
def test_the_check_catches_a_planted_core_import(source, expected):
    assert core_reaches(source) == expected


def test_the_check_allows_the_sdk_and_the_top_level_api():
    source = (
        "import dloom\nimport dloom.sdk.cli\nfrom dloom import hookimpl, sdk\n"
        "from dloom.sdk import KernelStep\nfrom dloom.sdk.zoo import MODEL_NAMES\n"
        "from . import plugin\nmarker = dloom.hookimpl\n"
    )
    assert core_reaches(source) == []


@pytest.mark.parametrize("name", SDK_MODULES)
def test_every_sdk_name_resolves(name):
    module = importlib.import_module(name)
    assert module.__doc__ and "version policy" in module.__doc__.lower()
    assert len(module.__all__) == len(set(module.__all__)) > 1
    missing = [exported for exported in module.__all__ if not hasattr(module, exported)]
    assert missing == []


def test_the_sdk_cli_reports_where_the_command_line_reports(monkeypatch):
    """A plugin's command prints and fails through the command line's consoles and report,
    even when those are swapped (as the tests of the core's commands swap them)."""
    from rich.console import Console

    from dloom.cli import commands
    from dloom.sdk import cli

    swapped, swapped_err = Console(width=50), Console(width=60, stderr=True)
    reported: list[Exception] = []
    monkeypatch.setattr(commands, "console", swapped)
    monkeypatch.setattr(commands, "err_console", swapped_err)
    monkeypatch.setattr(commands, "fail", reported.append)
    error = dloom.sdk.ConfigurationError("bad")
    cli.fail(error)
    assert cli.stdout() is swapped and cli.stderr() is swapped_err and reported == [error]


def test_the_sdk_holds_the_whole_top_level_api():
    """A plugin needs one import path: every top-level name is in the SDK too, the same object."""
    assert [name for name in dloom.__all__ if getattr(dloom.sdk, name, None) is not getattr(dloom, name)] == []
