"""The Fréchet commit rule on hand-worked profiles, in a decoder, and on the command line."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

import dloom
from dloom import BlockSchedule, DiffusionDecoder
from dloom.cli.commands import app
from dloom.errors import CompositionError, ConfigurationError
from dloom.hooks.composition import compose
from dloom.hooks.registry import get_registry
from dloom_plugins.baselines import FactorCommit
from dloom_plugins.frechet import FrechetCommit, frechet_bounds


def commit(rule, confidence, selectable):
    c = torch.tensor(confidence, dtype=torch.float64)
    s = torch.tensor(selectable, dtype=torch.bool)
    schedule = BlockSchedule(torch.zeros_like(s.sum(-1)), 1, s.sum(-1))
    return rule.dloom_select_commit(confidence=c, selectable=s, schedule=schedule).tolist()


def bounds(sorted_confidence):
    return [t[0].tolist() for t in frechet_bounds(torch.tensor([sorted_confidence], dtype=torch.float64))]


# --- hand-worked profiles ----------------------------------------------------------------


def test_bounds_of_a_worked_profile():
    # sorted 0.95, 0.9, 0.8, 0.3; wrong 0.05, 0.1, 0.2, 0.7; running deficit 0.05, 0.15, 0.35, 1.05
    lower, upper, gap = bounds([0.95, 0.9, 0.8, 0.3])
    assert lower == pytest.approx([0.95, 0.85, 0.65, 0.0], abs=1e-15)
    assert upper == pytest.approx([0.05, 0.1, 0.2, 0.7], abs=1e-15)
    assert gap == pytest.approx([0.9, 0.75, 0.45, -0.7], abs=1e-15)


def test_delta_sets_how_far_the_prefix_reaches():
    conf, sel = [[0.3, 0.95, 0.8, 0.9]], [[1, 1, 1, 1]]  # gaps 0.9, 0.75, 0.45, -0.7
    assert commit(FrechetCommit(0.0), conf, sel) == [[False, True, True, True]]
    assert commit(FrechetCommit(0.5), conf, sel) == [[False, True, False, True]]
    assert commit(FrechetCommit(0.8), conf, sel) == [[False, True, False, False]]
    assert commit(FrechetCommit(0.95), conf, sel) == [[False, True, False, False]]  # G_1 fails: top one


def test_heterogeneous_profile_commits_more_than_the_factor_rule():
    # sorted 0.99, 0.99, 0.99, 0.7: G_4 = 1 - 0.33 - 0.3 = 0.37 > 0
    #   = factor core 5 * 0.7 - 4 = -0.5, plus bonus 3 * (0.99 - 0.7) = 0.87.
    # The factor rule stops at 3: (4 + 1)(1 - 0.7) = 1.5 >= 1.
    conf, sel = [[0.7, 0.99, 0.99, 0.99]], [[1, 1, 1, 1]]
    assert bounds([0.99, 0.99, 0.99, 0.7])[2][3] == pytest.approx(0.37, abs=1e-15)
    assert commit(FrechetCommit(0.0), conf, sel) == [[True, True, True, True]]
    assert commit(FactorCommit(1.0), conf, sel) == [[False, True, True, True]]


def test_flat_profile_is_the_factor_rule_exactly_at_its_boundary():
    # c = 0.75 everywhere (exact in binary): G = 0.5, 0.25, 0, -0.25; G_3 = 0 is not > 0,
    # just as the factor rule's (3 + 1)(1 - 0.75) = 1 is not < 1.
    assert bounds([0.75] * 4)[2] == [0.5, 0.25, 0.0, -0.25]
    conf, sel = [[0.75] * 4], [[1, 1, 1, 1]]
    assert commit(FrechetCommit(0.0), conf, sel) == commit(FactorCommit(1.0), conf, sel)
    assert sum(commit(FrechetCommit(0.0), conf, sel)[0]) == 2
    assert commit(FrechetCommit(0.25), conf, sel) == commit(FactorCommit(0.75), conf, sel)
    assert sum(commit(FrechetCommit(0.25), conf, sel)[0]) == 1


def test_commits_the_top_one_when_no_prefix_passes():
    # G_1 = 0.4 - 0.6 < 0
    assert commit(FrechetCommit(0.0), [[0.3, 0.4, 0.2]], [[1, 1, 1]]) == [[False, True, False]]


def test_ties_take_the_first_position():
    assert commit(FrechetCommit(0.0), [[0.4, 0.6, 0.6]], [[1, 1, 1]]) == [[False, True, False]]


def test_unselectable_positions_are_never_chosen():
    # Position 0 is the most confident but not selectable; then 0.97, 0.96, 0.2:
    # gaps 0.94, 0.89, -0.67.
    assert commit(FrechetCommit(0.0), [[0.99, 0.97, 0.96, 0.2]], [[0, 1, 1, 1]]) == [[False, True, True, False]]
    # Junk at unselectable positions (nan, inf, above one) is ignored.
    conf = [[math.nan, 0.6, math.inf, 2.0, 0.5]]
    assert commit(FrechetCommit(0.0), conf, [[0, 1, 0, 0, 1]]) == [[False, True, False, False, False]]


def test_the_tail_past_the_selectable_positions_never_passes():
    lower, upper, gap = bounds([0.99, 0.98, -math.inf, -math.inf])
    assert lower[2:] == [0.0, 0.0] and upper[2:] == [math.inf, math.inf]
    assert gap[2:] == [-math.inf, -math.inf]
    assert not any(math.isnan(v) for v in lower + upper + gap)


def test_rows_are_independent_and_empty_rows_commit_nothing():
    conf = [[0.3, 0.95, 0.8, 0.9], [0.99, 0.99, 0.99, 0.7], [0.9, 0.9, 0.9, 0.9], [0.4, 0.2, 0.1, 0.3]]
    sel = [[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]]
    together = commit(FrechetCommit(0.0), conf, sel)
    assert together == [commit(FrechetCommit(0.0), [c], [s])[0] for c, s in zip(conf, sel)]
    assert together[2] == [False] * 4
    assert [sum(row) for row in together] == [3, 4, 0, 1]


def test_float32_confidence_is_accepted():
    c = torch.tensor([[0.3, 0.95, 0.8, 0.9]], dtype=torch.float32)
    s = torch.ones(1, 4, dtype=torch.bool)
    out = FrechetCommit(0.0).dloom_select_commit(confidence=c, selectable=s, schedule=BlockSchedule(torch.zeros_like(s.sum(-1)), 1, s.sum(-1)))
    assert out.tolist() == [[False, True, True, True]]


# --- registration and parameters ---------------------------------------------------------


def test_registered_with_delta_in_zero_one():
    strategy = get_registry().get("frechet")
    assert strategy.plugin == "frechet"
    assert strategy.hooks == ("dloom_select_commit",)
    (delta,) = strategy.parameters
    assert (delta.name, delta.default, delta.kind, delta.allowed()) == ("delta", 0.5, float, "[0, 1)")
    assert "joint mode" in strategy.guarantee and "not lossless" in strategy.guarantee


def test_delta_default_and_value_reach_the_plugin():
    assert compose("frechet").components[0].plugin.delta == 0.5
    assert compose("frechet", {"delta": 0.3}).components[0].plugin.delta == 0.3


@pytest.mark.parametrize("delta", [-0.1, 1.0, 1.5, math.nan])
def test_delta_outside_zero_one_is_rejected(delta):
    with pytest.raises(ConfigurationError, match=r"parameter 'delta' of strategy 'frechet'.*allowed: \[0, 1\)"):
        compose("frechet", {"delta": delta})


# --- in a decoder ------------------------------------------------------------------------


def test_decodes_with_fewer_forwards_than_one_token_per_step(sharp_adapter):
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    quota = DiffusionDecoder(sharp_adapter, "quota", gen_length=16, block_length=8).generate(prompts)
    # δ = 0.75: this tiny model is not sure enough for δ = 0.97 to commit two at once
    frechet = DiffusionDecoder(sharp_adapter, "frechet", delta=0.75, gen_length=16, block_length=8).generate(prompts)
    assert frechet.forwards < quota.forwards
    assert bool((frechet.nfe <= quota.nfe).all()) and int(frechet.nfe.sum()) < int(quota.nfe.sum())
    assert all(sharp_adapter.mask_token_id not in row for row in frechet.token_lists)
    # a larger margin certifies less: never fewer forwards than delta = 0
    strict = DiffusionDecoder(sharp_adapter, "frechet", delta=0.9, gen_length=16, block_length=8).generate(prompts)
    assert strict.forwards >= frechet.forwards
    assert strict.config["params"] == {"frechet": {"delta": 0.9}}


class KeepPruner:
    """Answers only ``dloom_prune``: not a commit rule."""

    @dloom.hookimpl
    def dloom_prune(self, graph, budget):
        return graph


def test_composes_with_a_plugin_for_another_hook(sharp_adapter):
    decoder = DiffusionDecoder(sharp_adapter, ["frechet", KeepPruner()], gen_length=8, block_length=8)
    assert decoder.composition.provider("dloom_select_commit") == "frechet"
    alone = DiffusionDecoder(sharp_adapter, "frechet", gen_length=8, block_length=8)
    assert torch.equal(decoder.generate([[5, 6]]).generated, alone.generate([[5, 6]]).generated)


@pytest.mark.parametrize("spec", ["threshold+frechet", "frechet+factor"])
def test_two_commit_rules_are_a_composition_error(sharp_adapter, spec):
    with pytest.raises(CompositionError, match="dloom_select_commit"):
        DiffusionDecoder(sharp_adapter, spec, gen_length=8, block_length=4)


# --- command line ------------------------------------------------------------------------


def test_cli_lists_frechet_with_its_parameter():
    result = CliRunner().invoke(app, ["strategies", "--json"])
    assert result.exit_code == 0, result.output
    record = {r["name"]: r for r in json.loads(result.stdout)}["frechet"]
    assert record["plugin"] == "frechet"
    assert record["hooks"] == ["dloom_select_commit"]
    assert record["parameters"] == [
        {
            "name": "delta", "default": 0.5, "type": "float", "allowed": "[0, 1)",
            "help": "commit the largest n with L_n - U_n > delta (0: certified joint mode; "
                    "the default kept one token per step's accuracy within a point on a dev split)",
        }
    ]
    assert record["guarantee"].startswith("proven bound")


def test_cli_generates_with_frechet(tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    result = CliRunner().invoke(app, [
        "generate", "--model", str(tiny_model_dir), "--prompts", str(prompts), "--json",
        "--gen-length", "8", "--block-length", "4", "--strategy", "frechet", "--param", "delta=0.2",
    ])
    assert result.exit_code == 0, result.output
    (row,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert row["config"]["params"] == {"frechet": {"delta": 0.2}}
