"""Strategy composition: names, ``+``, plugin objects, parameter routing, and the checks that
run when a decoder is built (never mid-decode)."""

from __future__ import annotations

import pytest

import dloom
from dloom import DiffusionDecoder, Parameter, StrategyRegistration
from dloom.errors import CompositionError, ConfigurationError, UnknownStrategyError
from dloom.hooks.composition import (
    DEFAULTS_PLUGIN,
    CoreDefaults,
    build_plugin_manager,
    compose,
)
from dloom.hooks.registry import Registry, Strategy, get_registry
from dloom.hooks.timing import HookTimer
from dloom_plugins.baselines import FactorCommit, QuotaCommit, ThresholdCommit


class CommitAll:
    """A commit rule that unmasks every selectable position at once."""

    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        return selectable.clone()


class KeepPruner:
    """Implements only ``dloom_prune``: not a commit rule."""

    def __init__(self, budget: int = 4) -> None:
        self.budget = budget

    @dloom.hookimpl
    def dloom_prune(self, graph, budget):
        return graph


class DraftAndMask:
    """Speculates and lays out a verification forward, but never verifies."""

    @dloom.hookimpl
    def dloom_draft(self, state):
        return None

    @dloom.hookimpl
    def dloom_build_mask(self, state, graph):
        return None


class Hookless:
    def dloom_select_commit(self, confidence, selectable, schedule):  # no @hookimpl
        return selectable


@pytest.fixture
def registry_with_pruner() -> Registry:
    """The built-in strategies plus 'pruner' (params budget, tau) and 'shrink' (param tau)."""
    base = get_registry()
    extra = {
        "pruner": Strategy(
            "pruner",
            "test",
            StrategyRegistration(
                "pruner",
                lambda budget, tau: KeepPruner(budget),
                parameters=(
                    Parameter("budget", 4, int, low=1),
                    Parameter("tau", 0.5, float, low=0.0, high=1.0),
                ),
            ),
        ),
    }
    return Registry(strategies={**base.strategies, **extra}, plugins=dict(base.plugins))


# --- names and parameters ----------------------------------------------------------------


def test_threshold_with_tau_builds_a_threshold_commit():
    composition = compose("threshold", {"tau": 0.8})
    assert composition.name == "threshold"
    (component,) = composition.components
    assert isinstance(component.plugin, ThresholdCommit)
    assert component.plugin.tau == 0.8
    assert composition.params() == {"threshold": {"tau": 0.8}}
    assert composition.provider("dloom_select_commit") == "threshold"
    assert composition.provider("dloom_draft") is None
    assert composition.guarantees["threshold"].startswith("approximate")


def test_defaults_fill_parameters_not_given():
    assert compose("threshold").params() == {"threshold": {"tau": 0.7}}
    assert compose("factor").params() == {"factor": {"f": 1.0}}
    assert compose("quota").params() == {"quota": {}}


def test_strategy_dot_param_targets_one_component():
    composition = compose("threshold", {"threshold.tau": "0.75"})
    assert composition.params() == {"threshold": {"tau": 0.75}}
    assert composition.components[0].plugin.tau == 0.75


def test_dotted_param_naming_an_absent_strategy_is_rejected():
    with pytest.raises(ConfigurationError) as raised:
        compose("threshold", {"factor.f": 2})
    message = str(raised.value)
    assert "'factor.f'" in message
    assert "names strategy 'factor', which is not part of 'threshold'" in message
    assert "components: threshold" in message


def test_params_route_by_name_and_by_component(registry_with_pruner):
    composition = compose(
        "threshold+pruner", {"tau": "0.7", "pruner.budget": "3"}, registry_with_pruner
    )
    # "tau" is declared by both components and goes to both; "pruner.budget" only to pruner
    assert composition.params() == {
        "threshold": {"tau": 0.7},
        "pruner": {"budget": 3, "tau": 0.7},
    }
    assert composition.components[1].plugin.budget == 3
    assert composition.provider("dloom_prune") == "pruner"


def test_dotted_param_overrides_only_its_component(registry_with_pruner):
    composition = compose("threshold+pruner", {"pruner.tau": 0.2}, registry_with_pruner)
    assert composition.params() == {
        "threshold": {"tau": 0.7},
        "pruner": {"budget": 4, "tau": 0.2},
    }


def test_unknown_parameter_lists_allowed_ones(registry_with_pruner):
    with pytest.raises(ConfigurationError) as raised:
        compose("threshold", {"bogus": 1})
    assert str(raised.value) == "unknown parameter 'bogus' for strategy 'threshold'; allowed: tau (threshold)"
    with pytest.raises(ConfigurationError, match=r"allowed: budget \(pruner\), tau \(pruner\), tau \(threshold\)"):
        compose("threshold+pruner", {"bogus": 1}, registry_with_pruner)
    with pytest.raises(ConfigurationError, match=r"unknown parameter 'tau' for strategy 'quota'; allowed: none"):
        compose("quota", {"tau": 0.5})


@pytest.mark.parametrize(
    "value, shown",
    [
        (0, "0.0"),
        (1, "1.0"),
        (1.5, "1.5"),
        (-0.1, "-0.1"),
        ("2", "2.0"),
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        ("abc", "'abc'"),
    ],
)
def test_tau_out_of_range_names_value_and_interval(value, shown):
    with pytest.raises(ConfigurationError) as raised:
        compose("threshold", {"tau": value})
    message = str(raised.value)
    assert "parameter 'tau' of strategy 'threshold'" in message
    assert shown in message
    assert "(0, 1)" in message


def test_tau_of_the_wrong_type_names_the_value_and_type():
    with pytest.raises(ConfigurationError) as raised:
        compose("threshold", {"tau": "abc"})
    assert str(raised.value) == (
        "parameter 'tau' of strategy 'threshold' must be a float, got 'abc'; allowed: (0, 1)"
    )


def test_tau_inside_the_open_interval_is_accepted():
    assert compose("threshold", {"tau": 1e-9}).params()["threshold"]["tau"] == 1e-9
    assert compose("threshold", {"tau": "0.999"}).params()["threshold"]["tau"] == 0.999


# --- strategy names ----------------------------------------------------------------------


def test_unknown_strategy_lists_known_names_and_suggests():
    with pytest.raises(UnknownStrategyError) as raised:
        compose("treshold")
    assert str(raised.value) == (
        "unknown strategy 'treshold'; known strategies: dream, entropy_bound, factor, failfast, frechet, frechet_edit, joint_threshold, quota, spiffy, threshold, wino. "
        "Did you mean 'threshold'?"
    )
    assert isinstance(raised.value, KeyError)


def test_unknown_strategy_without_close_match_has_no_hint():
    with pytest.raises(UnknownStrategyError) as raised:
        compose("zzzz")
    assert "Did you mean" not in str(raised.value)
    assert "known strategies: dream, entropy_bound, factor, failfast, frechet, frechet_edit, joint_threshold, quota, spiffy, threshold, wino" in str(raised.value)


def test_two_commit_rules_are_a_composition_error():
    with pytest.raises(CompositionError) as raised:
        compose("threshold+factor")
    message = str(raised.value)
    assert "'threshold'" in message and "'factor'" in message
    assert "dloom_select_commit" in message
    assert "single-answer" in message


def test_duplicate_strategy_is_a_composition_error():
    with pytest.raises(CompositionError, match="strategy 'quota' appears twice"):
        compose("quota+quota")


@pytest.mark.parametrize("spec", ["threshold+", "+quota", "quota++threshold", ""])
def test_malformed_plus_spec_is_a_configuration_error(spec):
    with pytest.raises(ConfigurationError, match="malformed strategy"):
        compose(spec)


def test_spaces_around_plus_are_ignored(registry_with_pruner):
    composition = compose(" threshold + pruner ", registry=registry_with_pruner)
    assert composition.name == "threshold+pruner"


def test_composition_errors_are_raised_when_the_decoder_is_built(tiny_adapter):
    with pytest.raises(CompositionError):
        DiffusionDecoder(tiny_adapter, "threshold+factor", gen_length=8, block_length=4)


# --- plugin objects ----------------------------------------------------------------------


def test_plugin_object_works_in_a_decoder(tiny_adapter):
    decoder = DiffusionDecoder(tiny_adapter, CommitAll(), gen_length=8, block_length=4)
    assert decoder.config["strategy"] == "CommitAll"
    assert decoder.config["params"] == {"CommitAll": {}}
    result = decoder.generate([[5, 6, 7]])
    # every masked position of a block is committed by the block's first forward
    assert result.forwards == 2
    assert result.nfe.tolist() == [2]
    assert not (result.generated == tiny_adapter.mask_token_id).any()


def test_plugin_object_mixes_with_a_named_strategy(tiny_adapter):
    pruner = KeepPruner()
    decoder = DiffusionDecoder(tiny_adapter, ["quota", pruner], gen_length=8, block_length=8)
    assert decoder.composition.name == "quota+KeepPruner"
    assert decoder.composition.provider("dloom_prune") == "KeepPruner"
    assert decoder.pm.get_plugin("KeepPruner") is pruner
    assert decoder.generate([[5, 6]]).nfe.tolist() == [8]


def test_object_without_hooks_is_a_composition_error():
    with pytest.raises(CompositionError, match="implements no dloom hook; decorate its methods with @dloom.hookimpl"):
        compose(Hookless())


def test_plugin_object_answering_a_taken_hook_is_a_composition_error():
    with pytest.raises(CompositionError, match="'threshold' and 'CommitAll' both answer dloom_select_commit"):
        compose(["threshold", CommitAll()])


def test_draft_without_verify_is_a_composition_error():
    with pytest.raises(CompositionError) as raised:
        compose(["quota", DraftAndMask()])
    message = str(raised.value)
    assert "'quota+DraftAndMask' speculates (dloom_draft, dloom_build_mask)" in message
    assert "nothing provides dloom_verify" in message


def test_decoder_without_commit_rule_is_a_configuration_error(tiny_adapter):
    with pytest.raises(ConfigurationError, match="'KeepPruner' has no commit rule"):
        DiffusionDecoder(tiny_adapter, KeepPruner(), gen_length=8, block_length=4)


def test_two_plugin_classes_with_the_same_name_compose(tiny_adapter):
    Commit = type("Plugin", (CommitAll,), {})
    Prune = type("Plugin", (KeepPruner,), {})
    decoder = DiffusionDecoder(tiny_adapter, [Commit(), Prune()], gen_length=8, block_length=4)
    assert len(decoder.pm.get_plugins()) == 4


# --- the plugin manager ------------------------------------------------------------------


def test_plugin_manager_holds_exactly_strategy_defaults_and_timer():
    composition = compose("threshold", {"tau": 0.8})
    timer = HookTimer()
    pm = build_plugin_manager(composition, timer)
    threshold = composition.components[0].plugin
    defaults = pm.get_plugin(DEFAULTS_PLUGIN)
    assert isinstance(defaults, CoreDefaults)
    assert pm.get_plugins() == {threshold, defaults, timer}
    assert pm.get_plugin("threshold") is threshold
    # no registration hooks here: the strategy's module is not registered
    assert pm.hook.dloom_register_strategies.get_hookimpls() == []
    assert [i.plugin for i in pm.hook.dloom_select_commit.get_hookimpls()] == [threshold, timer]


def test_each_decoder_owns_its_plugin_manager(tiny_adapter):
    a = DiffusionDecoder(tiny_adapter, "threshold", tau=0.8, gen_length=8, block_length=4)
    b = DiffusionDecoder(tiny_adapter, "threshold", params={"tau": 0.95}, gen_length=8, block_length=4)
    assert a.pm is not b.pm
    assert a.pm.get_plugin("threshold").tau == 0.8
    assert b.pm.get_plugin("threshold").tau == 0.95
    assert a.pm.get_plugins() == {a.pm.get_plugin("threshold"), a.pm.get_plugin(DEFAULTS_PLUGIN), a.timer}


def test_keyword_params_and_params_mapping_are_merged(tiny_adapter):
    decoder = DiffusionDecoder(
        tiny_adapter, "threshold", params={"tau": 0.5}, gen_length=8, block_length=4, tau=0.6
    )
    assert decoder.config["params"] == {"threshold": {"tau": 0.6}}


def test_builtin_plugin_classes_are_the_registered_ones():
    registry = get_registry()
    assert registry.get("quota").registration.plugin_class is QuotaCommit
    assert registry.get("factor").registration.plugin_class is FactorCommit


# --- tracing -----------------------------------------------------------------------------


def test_dloom_trace_prints_each_hook_call_with_its_plugin(tiny_adapter, monkeypatch, capsys):
    monkeypatch.setenv("DLOOM_TRACE", "1")
    decoder = DiffusionDecoder(tiny_adapter, "threshold", gen_length=8, block_length=4)
    result = decoder.generate([[5, 6, 7]])
    lines = capsys.readouterr().err.splitlines()
    assert lines, "DLOOM_TRACE=1 printed nothing"
    assert lines[0] == "[dloom trace] dloom_configure -> (no plugin)"  # once, when built
    assert set(lines[1:]) == {"[dloom trace] dloom_select_commit -> threshold"}
    assert len(lines) - 1 == result.forwards  # one commit decision per forward


def test_no_trace_without_dloom_trace(tiny_adapter, monkeypatch, capsys):
    monkeypatch.setenv("DLOOM_TRACE", "0")
    DiffusionDecoder(tiny_adapter, "threshold", gen_length=8, block_length=4).generate([[5, 6, 7]])
    assert "[dloom trace]" not in capsys.readouterr().err
