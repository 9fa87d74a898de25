"""Third-party plugins: discovered through the ``dloom`` entry-point group, isolated, strict.

Every test installs a fake distribution without pip: a ``<name>-<version>.dist-info``
folder (``METADATA`` and ``entry_points.txt``) and a plugin module, side by side in a
temporary directory prepended to ``sys.path``. Module names are unique per test and purged
from ``sys.modules`` afterwards, so no plugin leaks into another test.
"""

from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

import dloom
from conftest import FakeSite
from dloom.cli import commands as cli
from dloom.cli.commands import app
from dloom.errors import PluginLoadError
from dloom.hooks.registry import get_registry, reset_registry

BUILTIN_STRATEGIES = {
    "quota", "dream", "threshold", "factor", "joint_threshold", "wino", "entropy_bound", "frechet", "frechet_edit", "spiffy",
    "failfast",
}
BUILTIN_PLUGINS = {"families", "baselines", "frechet", "spiffy", "failfast"}

TOPONE_SOURCE = """
    import torch
    import dloom


    class TopOne:
        '''Commit the single most confident selectable position of every row.'''

        @dloom.hookimpl
        def dloom_select_commit(self, confidence, selectable, schedule):
            ranked = torch.where(
                selectable, confidence, torch.full_like(confidence, -torch.inf)
            )
            top = ranked.argmax(dim=-1, keepdim=True)
            commit = torch.zeros_like(selectable).scatter_(-1, top, True)
            return commit & selectable


    @dloom.hookimpl
    def dloom_register_strategies(register):
        register(
            dloom.StrategyRegistration(
                name="topone",
                plugin_class=TopOne,
                guarantee="same as quota at one token per step",
                summary="one most confident position per step",
            )
        )
"""

IMPORT_ERROR_SOURCE = """
    raise ImportError("fakeplug needs the missing package 'frobnicate'")
"""

REGISTER_RAISES_SOURCE = """
    import dloom


    @dloom.hookimpl
    def dloom_register_strategies(register):
        raise RuntimeError("register hook exploded")
"""

DUPLICATE_SOURCE = """
    import dloom
    from dloom_plugins.baselines import ThresholdCommit


    @dloom.hookimpl
    def dloom_register_strategies(register):
        register(dloom.StrategyRegistration(name="threshold", plugin_class=ThresholdCommit))
"""

MISSPELT_HOOK_SOURCE = """
    import dloom
    from dloom_plugins.baselines import QuotaCommit


    @dloom.hookimpl
    def dloom_register_strategy(register):
        register(dloom.StrategyRegistration(name="misspelt", plugin_class=QuotaCommit))
"""


@pytest.fixture
def fakeplug(site) -> str:
    return site.install("fakeplug", TOPONE_SOURCE, version="1.2.3")


def plugins_json() -> dict:
    result = CliRunner().invoke(app, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# --- discovery -------------------------------------------------------------------------------


def test_fake_plugin_is_discovered_and_stamped(fakeplug):
    registry = get_registry()
    assert set(registry.strategies) == BUILTIN_STRATEGIES | {"topone"}
    topone = registry.get("topone")
    assert topone.plugin == "fakeplug"
    assert topone.hooks == ("dloom_select_commit",)
    assert topone.guarantee == "same as quota at one token per step"
    info = registry.plugins["fakeplug"]
    assert info.version == "1.2.3"
    assert info.builtin is False
    assert info.strategies == ("topone",)
    assert registry.plugins["baselines"].builtin is True
    assert registry.failures == []


def test_dloom_plugins_json_lists_the_fake_plugin(fakeplug):
    report = plugins_json()
    by_name = {p["name"]: p for p in report["plugins"]}
    assert by_name["fakeplug"] == {
        "name": "fakeplug",
        "version": "1.2.3",
        "builtin": False,
        "hooks": ["dloom_register_strategies", "dloom_select_commit"],
        "strategies": ["topone"],
    }
    assert by_name["baselines"]["strategies"] == [
        "quota", "dream", "threshold", "factor", "joint_threshold", "wino", "entropy_bound",
    ]
    assert report["failures"] == []


def test_dloom_plugins_table_marks_third_party(fakeplug, monkeypatch):
    monkeypatch.setattr(cli, "console", Console(width=200))
    result = CliRunner().invoke(app, ["plugins"])
    assert result.exit_code == 0, result.output
    assert "fakeplug (third party)" in result.stdout
    assert "1.2.3" in result.stdout


def test_fake_strategy_decodes_like_quota_at_one_token_per_step(fakeplug, tiny_adapter):
    prompts = [[5, 6, 7], [8, 9]]
    topone = dloom.DiffusionDecoder(tiny_adapter, "topone", gen_length=8, block_length=8)
    quota = dloom.DiffusionDecoder(tiny_adapter, "quota", gen_length=8, block_length=8)
    got, want = topone.generate(prompts), quota.generate(prompts)
    assert topone.config["strategy"] == "topone"
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.nfe, want.nfe)
    assert got.token_lists == want.token_lists
    # one token per forward: a row takes as many forwards as it generated positions
    assert int(got.nfe.max()) <= 8 and int(got.nfe.min()) >= 1


# --- DLOOM_PLUGINS ---------------------------------------------------------------------------


def test_empty_allow_list_loads_builtins_only(fakeplug, monkeypatch):
    monkeypatch.setenv("DLOOM_PLUGINS", "")
    registry = get_registry()
    assert set(registry.strategies) == BUILTIN_STRATEGIES
    assert set(registry.plugins) == BUILTIN_PLUGINS
    assert "fakeplug" not in {p["name"] for p in plugins_json()["plugins"]}


@pytest.mark.parametrize("allow", ["fakeplug", " fakeplug ,", "fakeplug,notinstalled"])
def test_allow_list_naming_the_plugin_loads_it(fakeplug, site, monkeypatch, allow):
    site.install("otherplug", TOPONE_SOURCE.replace('"topone"', '"othertop"'))
    monkeypatch.setenv("DLOOM_PLUGINS", allow)
    registry = get_registry()
    assert set(registry.strategies) == BUILTIN_STRATEGIES | {"topone"}
    assert set(registry.plugins) == BUILTIN_PLUGINS | {"fakeplug"}


def test_without_allow_list_every_installed_plugin_loads(fakeplug, site):
    site.install("otherplug", TOPONE_SOURCE.replace('"topone"', '"othertop"'))
    assert set(get_registry().strategies) == BUILTIN_STRATEGIES | {"topone", "othertop"}


# --- broken plugins: reported and skipped, or fatal under DLOOM_STRICT_PLUGINS -------------

BROKEN = {
    "importfail": (IMPORT_ERROR_SOURCE, "ImportError: fakeplug needs the missing package 'frobnicate'"),
    "raiser": (REGISTER_RAISES_SOURCE, "RuntimeError: register hook exploded"),
    "misspelt": (MISSPELT_HOOK_SOURCE, "dloom_register_strategy"),
}


@pytest.mark.parametrize("dist", sorted(BROKEN))
def test_broken_plugin_is_reported_and_skipped(site, dist):
    source, error = BROKEN[dist]
    site.install(dist, source)
    with pytest.warns(RuntimeWarning, match=f"dloom plugin '{dist}' was skipped") as caught:
        registry = get_registry()
    assert error in str(caught[0].message)
    assert [f.name for f in registry.failures] == [dist]
    assert error in registry.failures[0].error
    assert set(registry.strategies) == BUILTIN_STRATEGIES
    assert dist not in registry.plugins


@pytest.mark.parametrize("dist", sorted(BROKEN))
def test_broken_plugin_is_fatal_in_strict_mode(site, dist, monkeypatch):
    source, error = BROKEN[dist]
    site.install(dist, source)
    monkeypatch.setenv("DLOOM_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match=f"dloom plugin '{dist}' was skipped") as raised:
        get_registry()
    assert error in str(raised.value)
    assert "DLOOM_STRICT_PLUGINS=1" in str(raised.value)


def test_misspelt_hook_is_pluggys_unknown_hook_error(site):
    site.install("misspelt", MISSPELT_HOOK_SOURCE)
    with pytest.warns(RuntimeWarning):
        registry = get_registry()
    assert registry.failures[0].error.startswith("PluginValidationError: unknown hook")
    assert "misspelt" not in registry.strategies


def test_broken_plugin_does_not_hide_healthy_ones(fakeplug, site):
    site.install("importfail", IMPORT_ERROR_SOURCE)
    site.install("raiser", REGISTER_RAISES_SOURCE)
    with pytest.warns(RuntimeWarning):
        registry = get_registry()
    assert {f.name for f in registry.failures} == {"importfail", "raiser"}
    assert set(registry.strategies) == BUILTIN_STRATEGIES | {"topone"}
    report = plugins_json()
    assert {f["name"] for f in report["failures"]} == {"importfail", "raiser"}


def test_broken_plugin_is_shown_as_skipped_by_dloom_plugins(site):
    site.install("raiser", REGISTER_RAISES_SOURCE)
    with pytest.warns(RuntimeWarning):
        result = CliRunner().invoke(app, ["plugins"])
    assert result.exit_code == 0, result.output
    assert "skipped raiser: RuntimeError: register hook exploded" in " ".join(result.stderr.split())


def test_failed_registration_registers_nothing(site):
    """A plugin whose hook registers one strategy and then fails leaves no trace."""
    site.install(
        "halfway",
        """
        import dloom
        from dloom_plugins.baselines import QuotaCommit


        @dloom.hookimpl
        def dloom_register_strategies(register):
            register(dloom.StrategyRegistration(name="halfway", plugin_class=QuotaCommit))
            raise RuntimeError("second strategy failed")
        """,
    )
    with pytest.warns(RuntimeWarning, match="second strategy failed"):
        registry = get_registry()
    assert "halfway" not in registry.strategies
    assert "halfway" not in registry.plugins


def test_duplicate_strategy_name_is_skipped_when_builtins_load_first(tmp_path, monkeypatch):
    """With the plugin *after* dloom on ``sys.path`` the duplicate is the one reported."""
    root = tmp_path / "late-site"
    root.mkdir()
    fake = FakeSite(root)
    monkeypatch.setattr(sys, "path", [*sys.path, str(root)])
    fake.install("dupplug", DUPLICATE_SOURCE)
    try:
        with pytest.warns(RuntimeWarning, match="'threshold' is already registered by plugin 'baselines'"):
            registry = get_registry()
        assert [f.name for f in registry.failures] == ["dupplug"]
        assert registry.get("threshold").plugin == "baselines"
        assert set(registry.strategies) == BUILTIN_STRATEGIES
    finally:
        for module in fake.modules:
            sys.modules.pop(module, None)


def test_duplicate_strategy_name_never_displaces_builtins(site):
    site.install("dupplug", DUPLICATE_SOURCE)
    with pytest.warns(RuntimeWarning, match="'threshold' is already registered by plugin 'baselines'"):
        registry = get_registry()
    assert [f.name for f in registry.failures] == ["dupplug"]
    assert set(registry.strategies) == BUILTIN_STRATEGIES


def test_duplicate_strategy_name_is_fatal_in_strict_mode(site, monkeypatch):
    site.install("dupplug", DUPLICATE_SOURCE)
    monkeypatch.setenv("DLOOM_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match="strategy 'threshold' is already registered"):
        get_registry()


def test_third_party_entry_point_named_like_a_builtin_cannot_replace_it(site, monkeypatch):
    site.install("impostor", TOPONE_SOURCE, ep_name="baselines")
    monkeypatch.setenv("DLOOM_PLUGINS", "")
    registry = get_registry()
    assert set(registry.strategies) == BUILTIN_STRATEGIES
    assert registry.plugins["baselines"].builtin is True


def test_entry_point_must_name_a_module(site):
    module = site.install("attrplug", TOPONE_SOURCE)
    info = next(site.root.glob("attrplug-*.dist-info"))
    (info / "entry_points.txt").write_text(f"[dloom]\nattrplug = {module}:TopOne\n")
    importlib.invalidate_caches()
    with pytest.warns(RuntimeWarning, match="must name a module"):
        registry = get_registry()
    assert [f.name for f in registry.failures] == ["attrplug"]


# --- plugin-owned commands and options --------------------------------------------------------

COMMAND_SOURCE = """
    import typer
    import dloom
    from dloom_plugins.baselines import ThresholdCommit


    @dloom.hookimpl
    def dloom_register_commands(cli):
        @cli.command()
        def hello(name: str = typer.Option("world", help="Whom to greet.")):
            '''Greet someone (a third-party command).'''
            print(f"hello {name}")


    @dloom.hookimpl
    def dloom_register_strategies(register):
        register(dloom.StrategyRegistration(
            name="gate", plugin_class=ThresholdCommit,
            parameters=(dloom.Parameter("tau", 0.9, float, "the gate's threshold", low=0.0, high=1.0,
                                        low_open=True, high_open=True),),
            options=("tau",),
        ))
"""

CORE_NAMED_COMMAND_SOURCE = """
    import dloom


    @dloom.hookimpl
    def dloom_register_commands(cli):
        @cli.command()
        def generate():
            '''Would shadow the core's generate.'''

        @cli.command()
        def wave():
            '''A command of its own.'''
            print("wave")
"""


def test_a_third_party_plugin_adds_a_command_listed_in_help(site):
    site.install("cmdplug", COMMAND_SOURCE)
    runner = CliRunner()
    result = runner.invoke(app, ["hello", "--name", "dloom"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "hello dloom\n"
    listing = runner.invoke(app, ["--help"]).output
    assert "hello" in listing and "Greet someone" in listing and "calibrate" in listing
    assert "dloom_register_commands" in plugins_json()["plugins"][-1]["hooks"]


def test_a_strategy_option_is_taken_by_generate_eval_and_check_as_its_param(site, monkeypatch):
    site.install("cmdplug", COMMAND_SOURCE)
    monkeypatch.setenv("COLUMNS", "300")  # rich wraps help at the terminal's width
    monkeypatch.setenv("TERMINAL_WIDTH", "300")
    for command in ("generate", "eval", "check"):
        listing = " ".join(CliRunner().invoke(app, [command, "--help"]).output.split())
        assert "--tau" in listing and "gate: the gate's threshold." in listing, command
        assert "--budget" in listing and "--layout" in listing and "--graph" in listing, command
    seen = {}

    def build_decoder(model, strategy, param, **settings):
        seen["param"] = list(param)
        raise dloom.errors.ConfigurationError("stop here")

    monkeypatch.setattr(cli, "build_decoder", build_decoder)
    result = CliRunner().invoke(app, ["generate", "x", "--strategy", "gate", "--param", "gate.tau=0.1", "--tau", "0.5"])
    assert result.exit_code == 2 and "stop here" in result.output
    assert seen["param"] == ["gate.tau=0.1", "gate.tau=0.5"]  # the option comes last and wins


def test_a_strategy_option_value_is_checked_by_its_parameter(site):
    site.install("cmdplug", COMMAND_SOURCE)
    result = CliRunner().invoke(app, ["generate", "x", "--strategy", "gate", "--tau", "1.5"])
    assert result.exit_code == 2
    assert "parameter 'tau' of strategy 'gate' is 1.5; allowed: (0, 1)" in " ".join(result.output.split())
    result = CliRunner().invoke(app, ["generate", "x", "--strategy", "quota", "--tau", "0.5"])
    assert result.exit_code == 2 and "gate" in result.output  # quota has no gate component


def test_a_plugin_command_named_like_a_core_command_is_skipped(site):
    site.install("shadow", CORE_NAMED_COMMAND_SOURCE)
    with pytest.warns(RuntimeWarning, match="declares command 'generate', which the core has already"):
        result = CliRunner().invoke(app, ["wave"])
    assert result.exit_code == 0 and result.stdout == "wave\n"
    assert [f.name for f in get_registry().failures] == ["shadow:generate"]
    result = CliRunner().invoke(app, ["generate", "--help"])
    assert "Decode prompts with a strategy" in result.output


@pytest.mark.parametrize("change, message", [
    ('decoder="quantum"', "names decoder 'quantum'; allowed: diffusion, ar-target"),
    ('options=("depth",)', "offers option 'depth', which is none of its parameters (tau)"),
    ('options=("tau",), name="gate2"', "offers option --tau, which strategy 'gate' already owns"),
])
def test_a_registration_with_a_bad_decoder_or_option_is_skipped(site, change, message):
    source = COMMAND_SOURCE if "gate2" in change else COMMAND_SOURCE.replace('options=("tau",)', change)
    if "gate2" in change:
        site.install("cmdplug", COMMAND_SOURCE)
        source = COMMAND_SOURCE.replace('name="gate"', 'name="gate2"')
    site.install("badreg", source)
    with pytest.warns(RuntimeWarning, match=message.replace("(", r"\(").replace(")", r"\)")):
        registry = get_registry()
    assert "gate2" not in registry.strategies and [f.name for f in registry.failures][-1].startswith("badreg:")


def test_a_strategy_option_named_like_a_core_option_is_skipped(site, monkeypatch):
    site.install("seedplug", COMMAND_SOURCE.replace('"tau"', '"seed"').replace("the gate's threshold", "a seed")
                 .replace("0.9, float", "0, int").replace(", low=0.0, high=1.0,\n", ",\n")
                 .replace("low_open=True, high_open=True", "low=0"))
    assert get_registry().get("gate").registration.options == ("seed",)
    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.setenv("TERMINAL_WIDTH", "300")
    with pytest.warns(RuntimeWarning, match="offers option --seed, which `dloom generate` already has"):
        result = CliRunner().invoke(app, ["generate", "--help"])
    assert result.exit_code == 0 and "Seed of the sampler" in result.output
    assert "gate: a seed" not in result.output
    monkeypatch.setenv("DLOOM_STRICT_PLUGINS", "1")
    reset_registry()
    result = CliRunner().invoke(app, ["generate", "--help"])
    assert result.exit_code == 2 and "DLOOM_STRICT_PLUGINS=1 makes this fatal" in " ".join(result.output.split())
