"""benchmarks/gpu/run_papers.py runs end to end on the real-format fixtures, on the CPU.

The script is meant for a GPU with real checkpoints; here it runs with the Dream and Qwen2.5
fixtures (given SDAR's Qwen tokenizer files, which they lack, so that text prompts encode):
every dLLM strategy and FailFast must run, none marked pending, skipped or failed, and a
``device_map`` that needs the missing accelerate package must stop the script with dloom's
message before anything decodes.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "real-families"
TOKENIZER_FILES = (
    "added_tokens.json", "chat_template.jinja", "merges.txt", "special_tokens_map.json",
    "tokenizer_config.json", "vocab.json",
)


@pytest.fixture(scope="module")
def run_papers():
    return importlib.import_module("benchmarks.gpu.run_papers")


def with_tokenizer(family: str, directory: Path) -> Path:
    shutil.copytree(FIXTURES / family / "checkpoint", directory)
    for name in TOKENIZER_FILES:
        shutil.copy(FIXTURES / "sdar" / "checkpoint" / name, directory)
    return directory


def test_every_configuration_runs_failfast_included(run_papers, tmp_path):
    dream, qwen = with_tokenizer("dream", tmp_path / "dream"), with_tokenizer("qwen2", tmp_path / "qwen2")
    out = tmp_path / "papers.json"
    code = run_papers.main([
        "--dream", str(dream), "--qwen", str(qwen), "-n", "2", "--batch-size", "2",
        "--gen-length", "8", "--block-length", "4", "--caches", "dual",
        "--dtype", "float32", "--device", "cpu", "--out", str(out),
    ])
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["model"], r["strategy"], r["cache"]) for r in runs] == [
        ("dream", s, c) for s, _ in run_papers.STRATEGIES for c in ("dual",)
    ] + [("qwen", "failfast", "none")]
    for run in runs:
        assert not {"pending", "skipped", "failed"} & set(run), run
        assert run["n"] == 2 and run["nfe_mean"] > 0 and len(run["outputs"]) == 2
    assert runs[-1]["loaded"]["attention"] == "causal"


def test_failfast_is_pending_only_without_its_two_models(run_papers):
    both = run_papers.plan(run_papers.parse_args(["--dream", "d", "--qwen", "q"]))
    assert both[-1]["strategy"] == "failfast" and "pending" not in both[-1]
    alone = run_papers.plan(run_papers.parse_args(["--qwen", "q"]))
    assert alone == [{"model": "qwen", "strategy": "failfast", "pending": run_papers.FAILFAST_NEEDS}]


def test_device_map_auto_needs_accelerate_and_is_not_the_default_without_it(run_papers, tmp_path, monkeypatch):
    """On a machine without accelerate (simulated: the dev extra installs it)."""
    import transformers

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else find_spec(name, *a))
    monkeypatch.setattr(transformers.utils, "is_accelerate_available", lambda *a: False)
    assert run_papers.device_map_of(run_papers.parse_args([])) is None
    dream = with_tokenizer("dream", tmp_path / "dream")
    with pytest.raises(SystemExit, match=r"error: device_map='auto' needs the accelerate package"):
        run_papers.main(["--dream", str(dream), "--device-map", "auto", "-n", "1", "--caches", "none"])
