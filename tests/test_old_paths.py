"""dloom 0.1's flat module paths still import for one release, with a ``DeprecationWarning``
naming the old and the new path, as the very module now at the new path; and nothing in this
repository uses an old path any more."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path
from unittest import mock

import pytest

from dloom.old_paths import MOVED, RENAMED_PACKAGES

ROOT = Path(__file__).resolve().parents[1]


def forget(name: str) -> None:
    """Drop ``name`` from the import system so that importing it runs the finder again."""
    sys.modules.pop(name, None)
    parent, _, leaf = name.rpartition(".")
    if parent in sys.modules and leaf in vars(sys.modules[parent]):
        delattr(sys.modules[parent], leaf)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_is_the_new_module(old):
    new = importlib.import_module(MOVED[old])
    forget(old)
    with pytest.warns(DeprecationWarning, match=f"^{re.escape(old)} moved to {re.escape(MOVED[old])};") as caught:
        module = importlib.import_module(old)
    assert module is new and sys.modules[old] is new
    assert vars(module) is vars(new)  # private names included
    assert all(w.filename == importlib.__file__ for w in caught)  # the caller's frame, not dloom's
    forget(old)


def test_the_warning_names_the_importing_line():
    forget("dloom.engine")
    with pytest.warns(DeprecationWarning) as caught:
        import dloom.engine  # noqa: F401 - the old path under test
    assert [w.filename for w in caught] == [__file__]
    forget("dloom.engine")


def test_mock_patch_through_an_old_path_patches_the_new_module():
    from dloom.decode import kernel

    forget("dloom.kernel")
    with pytest.warns(DeprecationWarning), mock.patch("dloom.kernel.eos_clear") as patched:
        assert kernel.eos_clear is patched
    assert kernel.eos_clear is not patched
    forget("dloom.kernel")


@pytest.mark.parametrize("package", sorted(RENAMED_PACKAGES))
def test_a_name_of_an_old_module_that_became_a_package_warns(package):
    new = importlib.import_module(RENAMED_PACKAGES[package])
    old_package = importlib.import_module(package)
    name = next(n for n in vars(new) if not n.startswith("__") and n not in vars(old_package))
    with pytest.warns(DeprecationWarning, match=f"^{re.escape(package)}.{name} moved to {re.escape(new.__name__)}.{name};"):
        assert getattr(old_package, name) is getattr(new, name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        old_package.no_such_name  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError):
            old_package.__wrapped__  # noqa: B018 - dunders are never an old name


def test_the_old_names_of_renamed_packages():
    with pytest.warns(DeprecationWarning, match="dloom.hooks.select_commit moved to dloom.hooks.calls.select_commit"):
        from dloom.hooks import select_commit
    from dloom.hooks.calls import select_commit as new

    assert select_commit is new
    with pytest.warns(DeprecationWarning, match="dloom.ar.ARTarget moved to dloom.ar.target.ARTarget"):
        from dloom.ar import ARTarget  # noqa: F401
    with pytest.warns(DeprecationWarning, match="dloom.cli.build_decoder moved to dloom.cli.commands.build_decoder"):
        from dloom.cli import build_decoder  # noqa: F401
    from dloom.cli import app  # the console script's entry point is no old name
    from dloom.cli.commands import app as commands_app

    assert app is commands_app


def test_the_old_trainer_command_runs_the_new_trainer_with_a_warning():
    old = subprocess.run([sys.executable, "-m", "dloom.zoo.train", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert old.returncode == 0, old.stderr
    assert old.stdout.startswith("usage: python -m dloom_training.train")
    assert ("DeprecationWarning: python -m dloom.zoo.train moved to `PYTHONPATH=training python -m "
            "dloom_training.train`") in old.stderr
    strict = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-m", "dloom.zoo.train", "--help"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert strict.returncode == 1 and strict.stdout == ""


def test_without_a_checkout_the_old_trainer_path_says_where_it_went(monkeypatch, tmp_path):
    from dloom import old_paths

    monkeypatch.setattr(old_paths, "TRAINING_DIR", tmp_path)  # an installed wheel: no training/
    forget("dloom.zoo.train")
    with pytest.raises(ModuleNotFoundError, match="run it there with `PYTHONPATH=training python -m dloom_training.train`"):
        importlib.import_module("dloom.zoo.train")


def test_importing_dloom_and_its_front_ends_uses_no_old_path():
    code = "import dloom, dloom.serve.app, dloom.ray, dloom.cli, dloom_plugins.spiffy, dloom_plugins.failfast, dloom_plugins.frechet, dloom_plugins.baselines"
    run = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


OLD_MODULE = re.compile(r"(?<![\w.])(" + "|".join(re.escape(o) for o in sorted(MOVED, key=len, reverse=True)) + r")(?!\w)")
OLD_NAME_IN_RENAMED = re.compile(r"(?<![\w.])(" + "|".join(re.escape(p) for p in RENAMED_PACKAGES) + r")\.(\w+)")
SUBMODULES = {p: {m.stem for m in (ROOT / "core" / p.replace(".", "/")).glob("*.py")} for p in RENAMED_PACKAGES}
THIS_FILE = Path(__file__).resolve()


def old_paths_in_text(text: str) -> list[str]:
    """The old module paths a text names: ``dloom.engine``, ``dloom.hooks.select_commit``."""
    found = [m.group(1) for m in OLD_MODULE.finditer(text)]
    found += [m.group(0) for m in OLD_NAME_IN_RENAMED.finditer(text)
              if m.group(2) not in SUBMODULES[m.group(1)] and m.group(0) != "dloom.cli.app"]
    return found


def old_paths_in_python(source: str) -> list[str]:
    """The old paths a module imports (``import``, ``from ... import``) or names in a string
    that is nothing but a dotted path (``mock.patch("dloom.engine.x")``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [p for a in node.names for p in old_paths_in_text(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += old_paths_in_text(node.module)
            found += [p for a in node.names for p in old_paths_in_text(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"[\w.]+(:\w+)?", node.value):
            found += old_paths_in_text(node.value)
    return found


def repository_files() -> list[Path]:
    files = [p for folder in ("core", "plugins", "tests", "proofs_tests", "benchmarks", "training", "docs")
             for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".md"}]
    return [p for p in files + [ROOT / "README.md", ROOT / "mkdocs.yml", ROOT / "pyproject.toml"]
            if "checkpoints" not in p.parts and p.resolve() not in {THIS_FILE, ROOT / "core" / "dloom" / "old_paths.py"}]


def test_the_checks_see_old_paths():
    assert old_paths_in_text("see `dloom.engine` and dloom.hooks.select_commit, dloom.hooks.calls, dloom.cli:app") == [
        "dloom.engine", "dloom.hooks.select_commit"]
    assert old_paths_in_python(
        "from dloom import engine\nfrom dloom.cli import fail\nimport dloom.cache\n"
        "mock.patch('dloom.kernel.eos_clear')\n'''prose naming dloom.oracle is a docstring'''\n"
    ) == ["dloom.engine", "dloom.cli.fail", "dloom.cache", "dloom.kernel"]


NOTICES = {"training/README.md: dloom.zoo.train"}
"""Where an old path is named to say that it is deprecated (the trainer's old command)."""


def test_nothing_in_the_repository_uses_an_old_path():
    used = []
    for path in repository_files():
        text = path.read_text()
        # benchmarks/ is checked in its imports only (its prose belongs to the benchmark reports)
        found = old_paths_in_python(text) if path.suffix == ".py" else old_paths_in_text(text)
        if path.suffix == ".py" and "benchmarks" not in path.relative_to(ROOT).parts:
            found += old_paths_in_text(text)
        used += [f"{path.relative_to(ROOT)}: {p}" for p in sorted(set(found))]
    assert sorted(set(used) - NOTICES) == []
