"""The documentation kept honest by tests.

* every hook in ``dloom.hooks.specs`` has a section in ``docs/hooks.md`` whose heading is its
  exact signature, and a test under ``tests/`` that exercises it;
* every built-in strategy has a page or section that names each of its parameters;
* every page is in the mkdocs navigation;
* every ```python block of ``docs/`` and the README runs (on the shipped toy models, CPU),
  except a block right after a ``<!-- no-run -->`` comment;
* the plugin tutorial (``docs/plugins.md``) builds: its files make a package that pip
  installs, ``dloom plugins`` lists it as documented, and its own tests pass;
* the plugin page lists the whole SDK, the API reference turns Sphinx roles into code, and
  no diagram needs a CDN;
* the README and the docs' home page show the headline table of the latest report, and
  Fréchet's default δ is the one that report chose at matched accuracy.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dloom.cli.commands import app
from dloom.hooks import specs as hookspecs
from dloom.hooks.registry import get_registry, reset_registry

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
NO_RUN = "<!-- no-run -->"
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.S | re.M)
SIGNATURE_HEADING = re.compile(r"^## (dloom_\w+)\(([^)]*)\)$", re.M)


def specs() -> dict[str, object]:
    """Every hook specification, by name (:data:`dloom.hooks.specs.HOOKS`)."""
    return {name: getattr(hookspecs, name) for name in hookspecs.HOOKS}


def hook_sections() -> dict[str, tuple[list[str], str]]:
    """``{hook: (documented argument names, section text)}`` from ``docs/hooks.md``."""
    text = (DOCS / "hooks.md").read_text()
    headings = list(SIGNATURE_HEADING.finditer(text))
    sections = {}
    for heading, following in zip(headings, [*headings[1:], None]):
        end = following.start() if following else len(text)
        body = text[heading.end():end].split("\n## ")[0]
        args = [a.strip() for a in heading.group(2).split(",") if a.strip()]
        assert heading.group(1) not in sections, f"{heading.group(1)} is documented twice"
        sections[heading.group(1)] = (args, body)
    return sections


# --- hooks -------------------------------------------------------------------------------


def test_every_hook_has_a_reference_section_and_nothing_else_does():
    assert set(hook_sections()) == set(specs())


@pytest.mark.parametrize("name", sorted(specs()))
def test_documented_signature_matches_the_spec(name):
    documented, _ = hook_sections()[name]
    assert documented == list(inspect.signature(specs()[name]).parameters)


@functools.cache
def collect_test_sources() -> dict[str, str]:
    """Source of every ``test_*`` function under ``tests/`` (this file excepted), by
    ``file::name``."""
    found = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                found[f"{path.name}::{node.name}"] = ast.get_source_segment(source, node)
    return found




def mentions(source: str, hook: str) -> bool:
    """Whether ``source`` implements or calls ``hook`` (directly or by its typed wrapper)."""
    return hook in source or f"hooks.{hook.removeprefix('dloom_')}(" in source


@pytest.mark.parametrize("name", sorted(specs()))
def test_every_hook_has_a_test(name):
    tests = [t for t, source in collect_test_sources().items() if mentions(source, name)]
    assert tests, f"no test under tests/ exercises {name}"


@pytest.mark.parametrize("name", sorted(specs()))
def test_the_tests_a_hook_section_names_exist_and_exercise_it(name):
    _, body = hook_sections()[name]
    named = re.findall(r"`((?:tests|proofs_tests)/(?:\w+/)?test_\w+\.py)`", body)
    assert named, f"the section of {name} names no test file"
    for path in named:
        assert mentions((ROOT / path).read_text(), name), f"{path} does not exercise {name}"


# --- strategies and navigation -----------------------------------------------------------


def builtin_strategies():
    registry = get_registry()
    return sorted(
        (s for s in registry.strategies.values() if registry.plugins[s.plugin].builtin),
        key=lambda s: s.name,
    )


def strategy_docs(name: str) -> str:
    """The page ``docs/strategies/NAME.md`` plus the ``## NAME`` section of strategies.md."""
    page = DOCS / "strategies" / f"{name}.md"
    text = (DOCS / "strategies.md").read_text()
    section = re.search(rf"^## {re.escape(name)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    return (page.read_text() if page.exists() else "") + (section.group(1) if section else "")


@pytest.mark.parametrize("name", [s.name for s in builtin_strategies()])
def test_every_builtin_strategy_is_documented_with_its_parameters(name):
    text = strategy_docs(name)
    assert text, f"strategy {name!r} has neither docs/strategies/{name}.md nor a section in strategies.md"
    for parameter in get_registry().get(name).parameters:
        assert f"`{parameter.name}`" in text, f"the docs of {name!r} do not name parameter {parameter.name!r}"


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS.rglob("*.md"):
        assert page.relative_to(DOCS).as_posix() in nav, f"{page} is not in mkdocs.yml's nav"


# --- code examples -----------------------------------------------------------------------


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """``(line, code)`` of every runnable ```python block of ``page``."""
    text = page.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        if match.group(1) != "python":
            continue
        before = text[: match.start()].rstrip().splitlines()
        if before and before[-1].strip() == NO_RUN:
            continue
        blocks.append((text.count("\n", 0, match.start()) + 1, match.group(3)))
    return blocks


PAGES_WITH_CODE = [p for p in PAGES if python_blocks(p)]


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_code_examples_run(page, tmp_path, monkeypatch):
    """A page's blocks run in order in one namespace, as a reader would paste them."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "docs_example"}
    for line, code in python_blocks(page):
        exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), namespace)


def test_no_run_marks_a_block_to_skip(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"```python\nx = 1\n```\n\n{NO_RUN}\n```python\nraise SystemExit\n```\n")
    assert [code for _, code in python_blocks(page)] == ["x = 1\n"]


# --- the plugin tutorial -----------------------------------------------------------------


def tutorial_files() -> dict[str, str]:
    """The files of the tutorial's package: code blocks with a ``title="PATH"``."""
    text = (DOCS / "plugins.md").read_text()
    return {
        re.search(r'title="([^"]+)"', match.group(2)).group(1): match.group(3)
        for match in FENCE.finditer(text)
        if "title=" in match.group(2)
    }


class Outcomes:
    """A pytest plugin counting the outcomes of a nested test run."""

    def __init__(self) -> None:
        self.outcomes: list[str] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.outcome != "passed":
            self.outcomes.append(report.outcome)


def test_the_plugin_tutorial_builds_installs_lists_and_passes_its_tests(tmp_path, monkeypatch):
    """pip builds and installs the tutorial's package (into a directory put on
    ``sys.path``), ``dloom plugins --json`` lists it exactly as documented, and its tests
    pass (run in this process, with dloom's pytest plugin, as ``python -m pytest tests``)."""
    package, site = tmp_path / "dloom-top-k", tmp_path / "site"
    files = tutorial_files()
    assert set(files) == {"pyproject.toml", "dloom_top_k.py", "tests/test_top_k.py"}
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--target", str(site), str(package)],
        check=True, capture_output=True,
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(sys, "path", list(sys.path))  # restored after the nested run's inserts
    monkeypatch.chdir(package)
    importlib.invalidate_caches()
    reset_registry()
    try:
        result = CliRunner().invoke(app, ["plugins", "--json"])
        assert result.exit_code == 0, result.output
        listed = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
        documented = json.loads(re.search(r"```json\n(.*?)```", (DOCS / "plugins.md").read_text(), re.S).group(1))
        assert listed["top-k"] == documented
        outcomes = Outcomes()
        code = pytest.main(["-q", "-p", "no:cacheprovider", "tests"], plugins=[outcomes])
        assert code == pytest.ExitCode.OK and outcomes.outcomes == ["passed"] * 3
    finally:
        for module in ("dloom_top_k", "test_top_k"):
            sys.modules.pop(module, None)
        reset_registry()


# --- the SDK and the API reference -------------------------------------------------------


def test_the_plugin_page_lists_the_whole_sdk():
    """The table of ``docs/plugins.md#the-sdk`` names each name of ``dloom.sdk`` once, and
    nothing else."""
    import dloom.sdk

    section = (DOCS / "plugins.md").read_text().split("\n## The SDK\n")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| For ")]
    assert sorted(re.findall(r"`(\w+)`", "\n".join(rows))) == sorted(dloom.sdk.__all__)


def sphinx_roles():
    spec = importlib.util.spec_from_file_location("sphinx_roles", ROOT / "docs_extensions" / "sphinx_roles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_reference_turns_sphinx_roles_into_code():
    markdown = sphinx_roles().markdown
    assert markdown("See :class:`~dloom.sdk.KernelStep` and :func:`dloom.sdk.commit_top`.") == (
        "See `KernelStep` and `dloom.sdk.commit_top`."
    )
    assert markdown(":meth:`~.settings.FailFastSettings.load` (:data:`HOOKS`)") == "`load` (`HOOKS`)"
    assert markdown("Decode::\n\n    decoder.generate(prompts)\n\nA :: B") == (
        "Decode:\n\n    decoder.generate(prompts)\n\nA :: B"
    )
    config = (ROOT / "mkdocs.yml").read_text()
    for option in ("docs_extensions/sphinx_roles.py:SphinxRoles", "inherited_members: false", 'filters: ["!^_"]'):
        assert option in config


def test_diagrams_render_offline():
    """No page draws with mermaid, which the theme fetches from a CDN: diagrams are text."""
    assert [p.name for p in PAGES if "```mermaid" in p.read_text()] == []
    assert "mermaid" not in (ROOT / "mkdocs.yml").read_text()


# --- the headline table ------------------------------------------------------------------


def marked(path: Path) -> str:
    text = path.read_text()
    found = re.search(r"<!-- report:headline:start -->\n(.*?)<!-- report:headline:end -->", text, re.S)
    assert found, f"{path} lacks the report:headline markers"
    return found.group(1).strip()


def test_readme_and_home_page_show_the_headline_of_the_latest_report():
    report = importlib.import_module("benchmarks.report")
    # The published report: the long-answer workload's in word tokens (the README names its command).
    latest = json.loads((ROOT / "benchmarks" / "results" / "report-words.json").read_text())
    assert marked(ROOT / "README.md") == report.headline_table(latest)
    assert marked(DOCS / "index.md") == report.headline_table(latest)


def test_threshold_and_frechet_defaults_are_the_settings_the_dev_split_chose():
    """Issue 42: the defaults τ and δ are the operating points chosen on the dev split (the
    fewest forwards within one point of one token per step's accuracy there), and the
    README and the docs' home page show that run's table."""
    published = json.loads((ROOT / "benchmarks" / "results" / "operating-points-words.json").read_text())
    registry = get_registry()
    for rule in ("threshold", "frechet"):
        choice = published["choices"][rule]
        (parameter,) = registry.get(rule).parameters
        assert choice["matched"], f"the dev split matched no setting of {rule}"
        assert (parameter.name, parameter.default) == (choice["parameter"], choice["value"])
    dev_quota = published["dev"]["rows"][0]
    assert dev_quota["name"] == "quota"
    assert published["choices"]["frechet"]["accuracy"] >= dev_quota["accuracy"] - published["tolerance"] - 1e-9
    module = importlib.import_module("benchmarks.operating_points")
    for path in (ROOT / "README.md", DOCS / "index.md"):
        found = re.search(r"<!-- report:operating-points:start -->\n(.*?)\n<!-- report:operating-points:end -->",
                          path.read_text(), re.S)
        assert found, f"{path} lacks the report:operating-points markers"
        assert found.group(1) == module.headline(published)


# --- the draft-graph example -------------------------------------------------------------
ELIDED = "…"


def _matches_with_elisions(shown, actual, where: str = "graph") -> None:
    """``shown`` (a documented excerpt) agrees with ``actual`` wherever it is not elided:
    ``"…"`` stands for any value, a ``"…"`` key for the keys not shown, and a trailing
    ``"…"`` list item for the items after the ones shown."""
    if shown == ELIDED:
        return
    if isinstance(shown, dict):
        assert isinstance(actual, dict), where
        for key, value in shown.items():
            if key != ELIDED:
                assert key in actual, f"{where}.{key} is not in the shipped file"
                _matches_with_elisions(value, actual[key], f"{where}.{key}")
        if ELIDED not in shown:
            assert set(shown) == set(actual), f"{where}: keys differ from the shipped file"
    elif isinstance(shown, list):
        if shown and shown[-1] == ELIDED:
            items = shown[:-1]
            assert len(actual) >= len(items), f"{where}: fewer items than the docs show"
        else:
            items = shown
            assert len(actual) == len(items), f"{where}: the number of items differs"
        for i, item in enumerate(items):
            _matches_with_elisions(item, actual[i], f"{where}[{i}]")
    else:
        assert shown == actual, f"{where}: the docs show {shown!r}, the shipped file has {actual!r}"


def test_the_spiffy_page_shows_the_shipped_quota_graph():
    page = (DOCS / "strategies" / "spiffy.md").read_text()
    example = json.loads(re.search(r"```json\n(.*?)```", page, re.S).group(1))
    shipped = json.loads((ROOT / "plugins" / "dloom_plugins" / "spiffy" / "graphs" / "toy-dllm__quota__b8.json").read_text())
    _matches_with_elisions(example, shipped)


def test_the_elision_matcher_catches_a_stale_figure():
    with pytest.raises(AssertionError, match="frequency"):
        _matches_with_elisions({"nodes": [{"frequency": 858}, ELIDED]}, {"nodes": [{"frequency": 859}, {}]})
    with pytest.raises(AssertionError, match="keys differ"):
        _matches_with_elisions({"a": 1}, {"a": 1, "b": 2})
