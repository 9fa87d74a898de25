"""benchmarks/gpu/probe.py: the real shapes, and an end-to-end smoke run on the CPU.

The probe is meant for the first GPU dloom is lent; this checks that its configs build
models of the released sizes (on the meta device, nothing allocated) and that ``--smoke``
(tiny widths, CPU) runs every section and writes the report.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch


@pytest.fixture(scope="module")
def probe():
    return importlib.import_module("benchmarks.gpu.probe")


@pytest.mark.parametrize(
    "name, billions, profile, attention",
    [("llada-8b", 8.02, "llada", "bidirectional"), ("dream-7b", 7.62, "dream", "bidirectional"),
     ("sdar-4b", 4.41, "sdar", "block-causal"), ("qwen2.5-7b", 7.62, "causal-lm", "causal")],
)
def test_configs_have_the_released_sizes(probe, name, billions, profile, attention):
    adapter = probe.build(name, False, torch.device("meta"), torch.bfloat16)
    parameters = sum(p.numel() for p in adapter.model.parameters())
    assert round(parameters / 1e9, 2) == billions
    assert (adapter.profile, adapter.attention) == (profile, attention)


def test_smoke_run_end_to_end(probe, tmp_path):
    out = tmp_path / "probe.json"
    assert probe.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["smoke"] is True and report["device"] == "cpu"
    assert [m["model"] for m in report["models"]] == list(probe.SHAPES)
    for model in report["models"]:
        assert model["parameters"] > 0 and len(model["forward_ms"]) == 4
        assert all(point["ms"] > 0 for point in model["forward_ms"])
        assert model["cuda_graph"] == {"captured": None, "why": "no CUDA device"}
        decodes = model.get("decode", [])
        if model["model"] == "qwen2.5-7b":
            assert decodes == []  # the AR target is not a dLLM: forward costs only
            continue
        assert {(d["strategy"], d["cache"]) for d in decodes} == {
            (s, c) for s, _ in probe.STRATEGIES for c in probe.CACHES
        }
        assert all(d["forwards"] >= 1 and d["wall_over_forward"] >= 1 for d in decodes), decodes
        assert all(d["host_syncs"] is None for d in decodes)  # observable on CUDA only


def test_unknown_model_is_refused(probe, capsys):
    with pytest.raises(SystemExit):
        probe.parse_args(["--models", "gpt-9"])
    assert "unknown model 'gpt-9'; allowed: llada-8b" in capsys.readouterr().err
