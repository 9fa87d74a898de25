"""The forward cost curve: interpolation, synthetic curves, the file format, measurement."""

from __future__ import annotations

import json

import pytest

from dloom.errors import ConfigurationError
from dloom.model.cost import CostCurve, measure_cost_curve


def test_a_curve_interpolates_between_points_and_extends_its_last_slope():
    curve = CostCurve((1, 3, 5), (1.0, 2.0, 6.0))
    assert curve(1) == 1.0 and curve(0.5) == 1.0
    assert curve(2) == pytest.approx(1.5)
    assert curve(4) == pytest.approx(4.0)
    assert curve(7) == pytest.approx(10.0)  # slope 2 past the last point
    assert curve.relative(3) == pytest.approx(2.0)


def test_synthetic_curves():
    linear = CostCurve.linear(base=2.0, per_node=0.5)
    assert linear(1) == 2.0 and linear(11) == pytest.approx(7.0) and linear(100) == pytest.approx(51.5)
    flat = CostCurve.flat(0.25)
    assert flat(1) == flat(11) == flat(1000) == 0.25
    assert flat.description == {"synthetic": "flat"}


@pytest.mark.parametrize("nodes, seconds, message", [
    ((), (), "at least one"),
    ((1, 2), (1.0,), "as many node counts as times"),
    ((2, 1), (1.0, 2.0), r"node counts are \[2, 1\]; allowed: increasing, >= 1"),
    ((0, 1), (1.0, 2.0), "allowed: increasing, >= 1"),
    ((1, 2), (1.0, 0.0), r"times are \[1.0, 0.0\]; allowed: > 0 seconds"),
])
def test_a_bad_curve_is_refused_naming_what_is_wrong(nodes, seconds, message):
    with pytest.raises(ConfigurationError, match=message):
        CostCurve(nodes, seconds)


def test_a_curve_file_round_trips_and_a_bad_one_is_refused(tmp_path):
    curve = CostCurve((1, 4), (0.5, 1.5), {"model": "m", "device": "cpu"})
    path = tmp_path / "cost.json"
    curve.save(path)
    assert CostCurve.load(path) == curve
    path.write_text(json.dumps({"format": "dloom-draft-graph", "version": 1}))
    with pytest.raises(ConfigurationError, match="is not a dloom cost curve"):
        CostCurve.load(path)
    path.write_text(json.dumps({"format": "dloom-cost-curve", "version": 1, "points": [{"nodes": 1}]}))
    with pytest.raises(ConfigurationError, match="'points' must be a list"):
        CostCurve.load(path)
    with pytest.raises(ConfigurationError, match="does not exist"):
        CostCurve.load(tmp_path / "missing.json")


@pytest.mark.parametrize("layout", ["rows", "packed"])
def test_measurement_times_every_point_and_is_kept_for_the_process(tiny_adapter, layout):
    curve = measure_cost_curve(tiny_adapter, seq_len=12, nodes=(1, 3, 6), layout=layout, span=4, repeats=2)
    assert curve.nodes == (1, 3, 6)
    assert all(later >= earlier > 0 for earlier, later in zip(curve.seconds, curve.seconds[1:]))
    assert curve.description["layout"] == layout and curve.description["seq_len"] == 12
    assert curve.description["model"] == tiny_adapter.name
    again = measure_cost_curve(tiny_adapter, seq_len=12, nodes=(1, 3, 6), layout=layout, span=4, repeats=2)
    assert again is curve


def test_the_cached_layout_times_a_causal_models_steps_after_its_cache_and_leaves_it_as_it_was():
    from dloom.check.tiny import tiny_ar, tiny_dllm
    from dloom.errors import ModelError

    target = tiny_ar(0, vocab=16, hidden=16, layers=1, context=64)
    calls = []
    raw_logits = target.raw_logits

    def counted(ids, *args, **kwargs):
        calls.append((ids.shape[1], kwargs["cache"].get_seq_length()))
        return raw_logits(ids, *args, **kwargs)

    target.raw_logits = counted  # type: ignore[method-assign]
    curve = measure_cost_curve(target, seq_len=20, nodes=(1, 4), layout="cached", repeats=2, warmup=1)
    assert curve.nodes == (1, 4) and curve.description["layout"] == "cached"
    # the prefill of 20 columns, then every timed forward continues exactly those 20
    assert calls[0] == (20, 0) and set(calls[1:]) == {(1, 20), (4, 20)} and len(calls) == 1 + 1 + 2 * 2 * 2
    with pytest.raises(ModelError, match="'bidirectional' attention; an AR target needs 'causal'"):
        measure_cost_curve(tiny_dllm(0, vocab=16, hidden=16, layers=1, context=64), seq_len=8, layout="cached")


@pytest.mark.parametrize("options, message", [
    ({"layout": "tree"}, "layout is 'tree'; allowed: rows, packed, cached"),
    ({"seq_len": 0}, "seq_len is 0; allowed: an integer >= 1"),
    ({"repeats": 0}, "repeats is 0; allowed: an integer >= 1"),
    ({"nodes": (2, 2)}, r"nodes are \[2, 2\]; allowed: increasing integers >= 1"),
])
def test_bad_measurement_settings_are_refused(tiny_adapter, options, message):
    with pytest.raises(ConfigurationError, match=message):
        measure_cost_curve(tiny_adapter, **{"seq_len": 8, **options})


def test_dloom_profile_prints_and_saves_the_curve_and_refuses_to_overwrite(tmp_path):
    from typer.testing import CliRunner

    from dloom.cli import app

    runner = CliRunner()
    out = tmp_path / "cost.json"
    result = runner.invoke(app, ["profile", "--seq-len", "16", "--nodes", "1,2", "--repeats", "1", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "forward cost of toy-dllm" in result.output and f"wrote {out}" in result.output
    curve = CostCurve.load(out)
    assert curve.nodes == (1, 2) and curve.description["seq_len"] == 16
    again = runner.invoke(app, ["profile", "--seq-len", "16", "--nodes", "1,2", "-o", str(out)])
    assert again.exit_code == 2 and "pass --force to overwrite it" in " ".join(again.output.split())
    forced = runner.invoke(app, ["profile", "--seq-len", "16", "--nodes", "1,2", "-o", str(out), "--force", "--json"])
    assert forced.exit_code == 0 and json.loads(forced.output)["format"] == "dloom-cost-curve"
    cached = runner.invoke(app, ["profile", "--model", "toy-ar", "--layout", "cached", "--seq-len", "8",
                                 "--nodes", "1,2", "--repeats", "1", "--json"])  # an AR model: no mask token
    assert cached.exit_code == 0, cached.output
    assert json.loads(cached.output)["layout"] == "cached"
    bad = runner.invoke(app, ["profile", "--nodes", "1,x"])
    assert bad.exit_code == 2 and "--nodes is '1,x'" in bad.output
