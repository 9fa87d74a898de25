"""``training/average.py``: the weighted mean of checkpoints, tensor by tensor."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dloom_training.checkpoints import save_model
from dloom_training.models import build_model

SCRIPT = Path(__file__).resolve().parents[2] / "training" / "average.py"


def _module():
    spec = importlib.util.spec_from_file_location("average", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checkpoint(directory: Path, seed: int, steps: int) -> Path:
    torch.manual_seed(seed)
    save_model(build_model("toy-ar-small"), directory)
    (directory / "progress.json").write_text(json.dumps({"steps": steps}))
    return directory


def test_the_average_is_the_weighted_mean_and_keeps_the_last_source_s_files(tmp_path):
    a, b = _checkpoint(tmp_path / "a", 0, 10), _checkpoint(tmp_path / "b", 1, 20)
    (b / "training-weights").mkdir()
    (b / "training-weights" / "model.safetensors").write_bytes((b / "model.safetensors").read_bytes())
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(SCRIPT), str(out), str(a), str(b), "--weights", "1,3"], check=True)
    mean, first, second = (load_file(str(d / "model.safetensors")) for d in (out, a, b))
    assert set(mean) == set(first)
    for name, tensor in mean.items():
        assert tensor.dtype == first[name].dtype
        expected = (first[name].float() + 3 * second[name].float()) / 4
        torch.testing.assert_close(tensor.float(), expected.to(tensor.dtype).float())
    assert any(not torch.equal(mean[n], second[n]) for n in mean)
    progress = json.loads((out / "progress.json").read_text())
    assert progress["steps"] == 20
    assert [(s["steps"], s["weight"]) for s in progress["averaged_from"]] == [(10, 1.0), (20, 3.0)]
    assert (out / "training-weights" / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (out / "config.json").read_text() == (b / "config.json").read_text()


def test_sources_that_do_not_match_are_refused(tmp_path):
    average = _module().average
    a = _checkpoint(tmp_path / "a", 0, 1)
    torch.manual_seed(0)
    save_model(build_model("toy-ar"), tmp_path / "wide")
    with pytest.raises(ValueError, match="holds other tensors than"):
        average([a, tmp_path / "wide"], [1.0, 1.0])
    with pytest.raises(ValueError, match="2 weights for 1 sources"):
        average([a], [1.0, 1.0])
    with pytest.raises(ValueError, match="weights must be positive"):
        average([a, a], [1.0, 0.0])
