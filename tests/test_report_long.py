"""``benchmarks/report.py`` on the long-answer workload: the full matrix (every rule under
every cache, Fréchet's δ sweep and choice, Spiffy with graphs calibrated on training prompts,
Spiffy against calibration size), FailFast against AR decoding and assisted generation, and
the targets checklist, on tiny random Llama models with the long-answer tokenizer built here."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaForCausalLM

from dloom import load_model
from dloom.errors import ConfigurationError
from dloom.evaluation import select_examples
from dloom.zoo import long_tasks
from dloom.zoo import tokenizer as tok
from dloom.zoo.tasks import is_held_out
from dloom_training.checkpoints import save_model
from dloom_training.models import build_config
from dloom_training.workloads import LONG

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- report:headline:start -->", "<!-- report:headline:end -->"


@pytest.fixture(scope="module")
def targets(report_module):
    return importlib.import_module("benchmarks.report_targets")


def tiny_model(name: str, directory: Path, hidden: int, layers: int, seed: int) -> Path:
    """A random ``name``-shaped (long workload) Llama with an untied, sharpened output layer,
    so that confidences vary and the rules take different numbers of steps."""
    config = build_config(name)
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = hidden, 2 * hidden, layers
    config.num_attention_heads = config.num_key_value_heads = 2
    config.head_dim = hidden // 2
    config.tie_word_embeddings = False
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    save_model(model, directory, LONG)
    return directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-long")
    return SimpleNamespace(
        dllm=tiny_model("long-dllm", root / "long-dllm", 32, 2, 0),
        ar=tiny_model("long-ar", root / "long-ar", 32, 2, 1),
        small=tiny_model("long-ar-small", root / "long-ar-small", 16, 1, 2),
    )


# --- the rules, on synthetic rows -------------------------------------------------------


def frechet_row(delta, accuracy, nfe):
    return {"name": f"frechet-{delta:g}", "delta": delta, "accuracy": accuracy, "nfe_mean": nfe}


def test_fréchet_delta_is_the_largest_saving_within_one_point_of_threshold(targets):
    threshold = {"accuracy": 0.90, "nfe_mean": 40.0}
    sweep = [frechet_row(0.0, 0.85, 20.0), frechet_row(0.1, 0.885, 24.0), frechet_row(0.25, 0.89, 26.0),
             frechet_row(0.5, 0.92, 30.0), frechet_row(0.75, 0.95, 36.0)]
    choice = targets.choose_delta(threshold, sweep)
    # δ = 0 saves most but is 5 points below, δ = 0.1 1.5 points below: δ = 0.25 (1 point below) wins
    assert (choice["delta"], choice["name"]) == (0.25, "frechet-0.25")
    assert choice["saving"] == pytest.approx(1 - 26 / 40)
    assert [c["matched"] for c in choice["candidates"]] == [False, False, True, True, True]
    # a wider tolerance admits δ = 0.1; a more accurate δ is matched too
    assert targets.choose_delta(threshold, sweep, tolerance=0.02)["delta"] == 0.1
    assert targets.choose_delta({"accuracy": 0.5, "nfe_mean": 40.0}, sweep)["delta"] == 0.0
    # ties go to the smaller δ; no δ matched: no choice
    tie = [frechet_row(0.5, 0.9, 30.0), frechet_row(0.25, 0.9, 30.0)]
    assert targets.choose_delta(threshold, tie)["delta"] == 0.25
    none = targets.choose_delta({"accuracy": 0.99, "nfe_mean": 40.0}, sweep)
    assert none["delta"] is None and none["saving"] is None
    assert targets.frechet_item({"frechet_choice": none})["met"] is False


def synthetic_report(failfast_forwards=None, assisted_forwards=None):
    rows = [
        {"name": "quota", "label": "quota", "nfe_mean": 100.0, "speculation": None},
        {"name": "threshold", "label": "threshold", "nfe_mean": 30.0, "speculation": None},
        {"name": "spiffy+quota", "label": "Spiffy over quota", "nfe_mean": 36.0, "speculation": {"guarantee": "lossless"},
         "identical_to_commit_rule": 1.0, "spiffy_max_saving": 12.0, "nfe_over_oracle": 1.5},
        {"name": "spiffy+threshold", "label": "Spiffy over threshold", "nfe_mean": 20.0, "speculation": {"guarantee": "lossless"},
         "identical_to_commit_rule": 1.0, "spiffy_max_saving": 3.0, "nfe_over_oracle": 1.25},
    ]
    methods = {
        "ar": {"target_forwards": 1000, "target_forwards_per_prompt": 100.0},
        "failfast@0.05": {"target_forwards": 100, "target_forwards_per_prompt": 10.0, "identical_to_ar": 0.9,
                          "accepted_per_round": 9.1, "drafter_tau": 0.05},  # fewer forwards, but lossy
        "failfast@0.9": {"target_forwards": 240, "target_forwards_per_prompt": 24.0, "identical_to_ar": 1.0,
                         "accepted_per_round": 3.2, "drafter_tau": 0.9},
        "assisted": {"target_forwards": 300, "target_forwards_per_prompt": 30.0},
    }
    if failfast_forwards is not None:
        methods["failfast@0.9"]["target_forwards"] = failfast_forwards
    if assisted_forwards is not None:
        methods["assisted"]["target_forwards"] = assisted_forwards
    choice = {"delta": 0.25, "saving": 0.3, "accuracy": 0.9, "nfe_mean": 21.0, "reference_accuracy": 0.9,
              "reference_nfe_mean": 30.0, "candidates": []}
    return {"rows": rows, "oracle": {"nfe_mean": 16.0, "reached_share": 1.0}, "frechet_choice": choice,
            "failfast": {"assistant": "small", "methods": methods, "best": "failfast@0.9"}}


def test_failfast_targets_use_the_lossless_drafter_tau_with_the_fewest_target_forwards(targets):
    failfast = importlib.import_module("benchmarks.report_failfast")
    results = {"failfast@0.05": {"target_forwards": 100, "identical_to_ar": 0.95},
               "failfast@0.5": {"target_forwards": 300, "identical_to_ar": 1.0},
               "failfast@0.9": {"target_forwards": 240, "identical_to_ar": 1.0}}
    assert failfast.choose_best(results, list(results)) == "failfast@0.9"
    assert failfast.choose_best(results, ["failfast@0.05", "failfast@0.5"]) == "failfast@0.5"
    assert failfast.choose_best(results, ["failfast@0.05"]) == "failfast@0.05"  # none lossless: the first
    assert failfast.failfast_method(0.1234567) != failfast.failfast_method(0.1234568)
    lossy = synthetic_report()
    lossy["failfast"]["methods"]["failfast@0.9"]["identical_to_ar"] = 0.9
    item = targets.checklist(lossy)[4]
    assert item["met"] is False and "no drafter τ measured (0.05, 0.9) was lossless" in item["detail"]


def test_failfast_is_timed_interleaved_and_modelled_with_costs_measured_in_the_run(tiny, report_module):
    failfast = importlib.import_module("benchmarks.report_failfast")
    drafter = load_model(str(tiny.dllm))
    examples = select_examples("long", 3)
    result = failfast.measure_failfast(drafter, str(tiny.ar), str(tiny.small), examples, long_tasks.FAMILIES,
                                       drafter_taus=[0.05, 0.9], repeats=2)
    methods, latency = result["methods"], result["latency"]
    assert result["repeats"] == 2 and result["chosen_by"] == "wall time"
    assert latency["target"] > 0 and latency["drafter"] > 0 and latency["assistant"] > 0
    assert latency["ratio"] == pytest.approx(latency["drafter"] / latency["target"])
    for m in methods.values():
        helper = m["helper"]
        assert m["modelled_seconds"] == pytest.approx(
            m["target_forwards"] * latency["target"] + (m["helper_forwards"] * latency[helper] if helper else 0))
        assert m["wall_speedup_vs_ar"] == pytest.approx(methods["ar"]["wall_seconds"] / m["wall_seconds"])
        assert m["identical_to_ar"] == 1.0
    # forwards are those of one pass: AR decoding prefills once, then one forward per token
    assert methods["ar"]["target_forwards"] == methods["ar"]["generated_tokens"] + len(examples)
    lossless = [n for n in methods if n.startswith("failfast@")]
    assert result["best"] == min(lossless, key=lambda n: methods[n]["wall_seconds"])


def test_forward_clock_counts_and_times_every_forward(report_module):
    failfast = importlib.import_module("benchmarks.report_failfast")
    layer = torch.nn.Linear(2, 2)
    clock = failfast.ForwardClock(layer)
    for _ in range(3):
        layer(torch.zeros(1, 2))
    assert clock.count == 3 and clock.seconds > 0
    runs = {"ar": [(None, {"target": 4, "drafter": 0}, {"target": 2.0, "drafter": 0.0}, 3.0)],
            "failfast@0.5": [(None, {"target": 2, "drafter": 5}, {"target": 9.0, "drafter": 1.0}, 2.0),
                             (None, {"target": 2, "drafter": 5}, {"target": 9.0, "drafter": 2.0}, 2.0)]}
    # the target's cost comes from AR decoding's decode steps only, the drafter's from FailFast
    assert failfast.forward_costs(runs) == {"target": 0.5, "drafter": 0.3}


def test_the_failfast_job_is_stored_under_its_drafter_taus(report_module):
    jobs = importlib.import_module("benchmarks.report_jobs")
    store = importlib.import_module("benchmarks.report_store").MeasurementStore(None, {"run": 1}, resume=False)
    keys = {store.key("failfast", jobs.Job("failfast", "failfast", {"target": None, "assistant": None,
                                                                   "drafter_taus": taus}).key_settings())
            for taus in ([0.05, 0.9], [0.05], [0.05, 0.9])}
    assert len(keys) == 2


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_worker_ends_when_its_report_is_killed(report_module):
    """A report killed by a signal cannot shut its pool down; its workers end themselves."""
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import multiprocessing, sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from benchmarks import report_jobs\n"
        "def work():\n"
        "    report_jobs.exit_with_parent(0.05)\n"
        "    time.sleep(120)\n"
        "if __name__ == '__main__':\n"
        "    child = multiprocessing.get_context('fork').Process(target=work)\n"
        "    child.start()\n"
        "    print(child.pid, flush=True)\n"
        "    time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.5)
        assert _running(child)  # working, until its parent goes
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 20
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(child)
    finally:
        parent.kill()


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_the_failfast_job_knows_its_models_by_their_files_not_their_names(report_module, tmp_path):
    """A checkpoint copied elsewhere (say into the zoo) keeps the key of the measurements made
    with it, whatever its training records say; other weights get another key."""
    jobs = importlib.import_module("benchmarks.report_jobs")
    store = importlib.import_module("benchmarks.report_store").MeasurementStore(None, {"run": 1}, resume=False)
    for name, weights, record in (("trained", b"w1", "{}"), ("shipped", b"w1", '{"steps": 9}'), ("other", b"w2", "{}")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(weights)
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "eval.json").write_text(record)
    (tmp_path / "trained" / "progress.json").write_text('{"finished": false}')
    key = lambda target: store.key("failfast", jobs.Job("failfast", "failfast", {
        "target": str(tmp_path / target), "assistant": None, "drafter_taus": [0.9]}).key_settings())
    assert key("trained") == key("shipped") != key("other")


def test_the_checklist_is_computed_from_the_report(targets):
    items = targets.checklist(synthetic_report())
    assert [item["met"] for item in items] == [True] * 6
    assert items[0]["measured"] == "30.0% at δ = 0.25"
    assert items[1]["measured"] == "1.50×, 100% identical"
    assert items[2]["measured"] == "2.78×, 100% identical" and "short" not in items[2]["detail"]
    assert items[3]["measured"] == "1.25× (Spiffy over threshold)"
    assert items[4]["measured"] == "4.17×, 100% identical"
    assert "drafter τ 0.9, the fewest target forwards of the lossless ones (τ measured: 0.05, 0.9)" in items[4]["detail"]
    assert items[5]["measured"] == "1.25× fewer"
    # change one input, the figure and the verdict follow
    assert targets.checklist(synthetic_report(assisted_forwards=200))[5]["met"] is False
    slower = synthetic_report(failfast_forwards=400)
    assert [item["met"] for item in targets.checklist(slower)][4:] == [False, False]
    report = synthetic_report()
    report["rows"][3]["identical_to_commit_rule"] = 0.95  # a lossy Spiffy misses its target
    assert targets.checklist(report)[1]["met"] is False
    report["rows"][2]["nfe_mean"] = 40.0
    assert targets.checklist(report)[2]["measured"].startswith("2.50×") and targets.checklist(report)[2]["met"]
    report["rows"][2]["nfe_mean"] = 45.0
    missed = targets.checklist(report)[2]
    assert (missed["measured"], missed["met"]) == ("2.22×, 100% identical", False) and "1.12× short" in missed["detail"]
    empty = targets.checklist({"rows": [], "oracle": {}, "frechet_choice": None, "failfast": None})
    assert [item["met"] for item in empty] == [None] * 6


def test_a_missed_target_says_why_from_the_run(targets):
    """Each missed target's detail gives the run's own figures behind the miss; change them and
    the explanation follows."""
    report = synthetic_report()
    report["rows"][0]["accuracy"] = 0.95
    report["frechet_choice"] = {
        "delta": 0.5, "saving": 0.1, "accuracy": 0.9, "nfe_mean": 27.0, "reference_accuracy": 0.9,
        "reference_nfe_mean": 30.0, "candidates": [
            {"delta": 0.0, "accuracy": 0.6, "saving": 0.4}, {"delta": 0.25, "accuracy": 0.7, "saving": 0.3},
            {"delta": 0.5, "accuracy": 0.9, "saving": 0.1}]}
    spiffy = report["rows"][3]
    spiffy["nfe_mean"], spiffy["acceptance_histogram"] = 25.0, [6, 3, 1]  # 1.2×: missed
    report["calibration"] = {"curve_cache": "dual", "curve": [
        {"rule": "threshold", "paths": 500, "nfe_ratio": 1.2}, {"rule": "threshold", "paths": 25, "nfe_ratio": 1.1},
        {"rule": "quota", "paths": 25, "nfe_ratio": 9.0}]}
    report["rows"][1].update(commit_rule="threshold", cache="none", delta=None, nfe_over_oracle=1.875)
    spiffy.update(commit_rule="threshold", cache="none", delta=None, nfe_over_oracle=1.5625)
    report["rows"][2]["nfe_over_oracle"] = 2.0  # the best stack is Spiffy over threshold
    items = targets.checklist(report)
    assert "the δ saving ≥ 25 % (δ ≤ 0.25) reach at most 70.0%, 20.0 points below threshold 0.9" in items[0]["detail"]
    assert "threshold 0.9 is itself 5.0 points below one token per step (95.0%)" in items[0]["detail"]
    assert "60% of its verifications accepted no draft (0.50 drafts each)" in items[1]["detail"]
    assert "calibrating on 500 paths instead of 25 moved its ratio from 1.10× to 1.20× (cache dual)" in items[1]["detail"]
    assert "its rule alone is 1.88× the oracle" in items[3]["detail"]
    assert all("closing it needs" in items[i]["detail"] for i in (0, 1, 3))
    spiffy["acceptance_histogram"] = [2, 3, 5]
    assert "20% of its verifications accepted no draft (1.30 drafts each)" in targets.checklist(report)[1]["detail"]
    met = targets.checklist(synthetic_report())
    assert not any("closing it needs" in item["detail"] for item in met)  # a met target needs no excuse


# --- workload and calibration -----------------------------------------------------------


def test_the_workload_comes_from_the_tokenizer(report_module, tmp_path):
    from transformers import AutoTokenizer

    assert report_module.workload_tasks(load_model("toy-dllm")) == "all"
    tok.save(tmp_path / "long", long_tasks.ALPHABET)
    tok.save(tmp_path / "digits", "0123456789")
    read = lambda name: SimpleNamespace(name=name, tokenizer=AutoTokenizer.from_pretrained(tmp_path / name))
    assert report_module.workload_tasks(read("long")) == "long"
    with pytest.raises(ConfigurationError, match="writes neither"):
        report_module.workload_tasks(read("digits"))


def test_calibration_sees_training_prompts_only(report_module, tiny, monkeypatch):
    calibration = importlib.import_module("benchmarks.report_calibration")
    measure = importlib.import_module("benchmarks.report_measure")
    evaluated = select_examples("long", 8)
    seen: list[str] = []
    original = calibration.calibrate

    def spy(decoder, prompts, *args, **kwargs):
        seen.extend(prompts)
        return original(decoder, prompts, *args, **kwargs)

    monkeypatch.setattr(calibration, "calibrate", spy)
    prompts = lambda k: [e.prompt for e in calibration.calibration_examples("long", k, 0, evaluated)]
    model = load_model(str(tiny.dllm))
    records = calibration.calibrate_sizes(model, measure.CONFIGS[1], [30, 150], prompts, 4,
                                          tiny.dllm.parent / "graphs", 2, {"split": "train"})
    assert records[-1]["paths"] >= 150 and records[-1]["prompts"] >= 2
    assert all(r["paths"] >= r["target_paths"] for r in records)
    training = {e.prompt: e.family for e in select_examples("long", 200, split="train")}
    assert seen and all(p in training and not is_held_out(training[p], p) for p in seen)
    assert not set(seen) & {e.prompt for e in evaluated}
    # a broken split is refused: held-out prompts, or the prompts the report evaluates on
    with pytest.raises(ConfigurationError, match="held out or evaluated"):
        calibration.calibration_examples("long", 8, 0, select_examples("long", 8, split="train"))
    monkeypatch.setattr(calibration, "select_examples", lambda tasks, n, seed, split: evaluated[:n])
    with pytest.raises(ConfigurationError, match="training-split prompts only"):
        calibration.calibration_examples("long", 4, 0)


def test_a_zoo_dllm_is_measured_with_its_zoo_partners_by_default(report_module, monkeypatch):
    assert report_module.zoo_partners("long-dllm") == ("long-ar", "long-ar-small")
    assert report_module.zoo_partners("toy-dllm") == ("toy-ar", "toy-ar-small")
    assert report_module.zoo_partners("long-dllm-words") == ("long-dllm-words-ar", "long-dllm-words-ar-small")
    assert report_module.zoo_partners("long-ar") == report_module.zoo_partners("/a/long-dllm") == (None, None)
    seen = {}

    def stop(model, n, batch_size, configs, command, settings):
        seen.update(model=model, n=n, command=command, target=settings.target, assistant=settings.assistant)
        raise SystemExit(0)

    monkeypatch.setattr(report_module, "run", stop)
    for argv, expected in (
        ([], ("long-dllm-words", 300, "long-dllm-words-ar", "long-dllm-words-ar-small", "python -m benchmarks.report -n 300")),
        (["--target", "none"], ("long-dllm-words", 300, None, None, "python -m benchmarks.report -n 300 --target none")),
        (["--model", "long-dllm"], ("long-dllm", 300, "long-ar", "long-ar-small",
                                    "python -m benchmarks.report --model long-dllm -n 300")),
        (["--model", "long-dllm", "--target", "toy-ar"],
         ("long-dllm", 300, "toy-ar", None, "python -m benchmarks.report --model long-dllm -n 300 --target toy-ar")),
        (["--model", "/a/dllm", "-n", "9"], ("/a/dllm", 9, None, None, "python -m benchmarks.report --model /a/dllm -n 9")),
        # where it writes and how it batches are part of the command that reproduces it
        (["--out", str(report_module.ROOT / "benchmarks/results/report-words.json"), "--batch-size", "8"],
         ("long-dllm-words", 300, "long-dllm-words-ar", "long-dllm-words-ar-small",
          "python -m benchmarks.report -n 300 --batch-size 8 --out benchmarks/results/report-words.json")),
    ):
        with pytest.raises(SystemExit):
            report_module.main(argv)
        assert (seen["model"], seen["n"], seen["target"], seen["assistant"], seen["command"]) == expected


@pytest.mark.parametrize("argv, message", [
    (["--deltas", "0,1.0"], "each δ must lie in"),
    (["--caches", "dual,none"], "'none' first"),
    (["--calibration-paths", "100", "--calibration-sizes", "25,250"], "each in 1 .. --calibration-paths"),
    (["--target", "none", "--assistant", "toy-ar-small"], "--assistant needs --target"),
    (["--model", "training/none", "--assistant", "toy-ar-small"], "--assistant needs --target"),
    (["--spiffy-budget", "0"], "--spiffy-budget 0: allowed: 1 or more"),
    (["--workers", "0"], "--workers 0: allowed: 1 or more"),
    (["--drafter-taus", "0.05,0"], "--drafter-taus '0.05,0': distinct thresholds, each in (0, 1)"),
    (["--target", "toy-ar", "--drafter-taus", "0.05,1"], "each in (0, 1) (FailFast's drafter_tau)"),
    (["--target", "none", "--drafter-taus", "0.5"], "--drafter-taus needs --target"),
    (["--drafter-taus", "0.9,0.9"], "distinct thresholds"),
    (["--drafter-taus", "high"], "take comma-separated numbers"),
    (["--matrix", "full", "--configs", "threshold"], "headline matrix"),
    (["--target", "toy-ar"], "drafter 'long-dllm-words' and target 'toy-ar' do not share a tokenizer"),
    (["--model", "toy-dllm", "--assistant", "long-ar-small"], "assistant 'long-ar-small' does not share target 'toy-ar'"),
])
def test_bad_options_are_refused_before_any_work(report_module, capsys, argv, message):
    with pytest.raises(SystemExit):
        report_module.main(argv)
    assert message in capsys.readouterr().err


# --- the whole run ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_report(report_module, tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("long-report")
    (root / "docs").mkdir()
    for name in ("README.md", "docs/index.md"):
        text = (ROOT / name).read_text()
        (root / name).write_text(f"{text.split(START)[0]}{START}\nstale table\n{END}{text.split(END)[1]}")
    report_module.main([
        "--model", str(tiny.dllm), "-n", "3", "--deltas", "0,0.5", "--calibration-paths", "150",
        "--calibration-sizes", "20", "--calibration-min-prompts", "2", "--target", str(tiny.ar),
        "--assistant", str(tiny.small), "--out", str(root / "report.json"), "--docs", str(root / "docs"),
        "--readme", str(root / "README.md"), "--graphs", str(root / "graphs"),
    ])
    return root, json.loads((root / "report.json").read_text())


RULES = ("quota", "threshold", "factor", "frechet-0", "frechet-0.5")
SPIFFY = ("spiffy+quota", "spiffy+threshold", "spiffy+factor", "spiffy+frechet")


@pytest.mark.slow
def test_the_long_model_runs_the_full_matrix(long_report):
    _, report = long_report
    assert (report["tasks"], report["matrix"], report["gen_length"], report["block_length"]) == ("long", "full", 128, 32)
    names = [row["name"] for row in report["rows"]]
    chosen = ("quota", "threshold", "factor", f"frechet-{report['frechet_choice']['delta']:g}")
    suffixes = ("", "/prefix", "/dual")
    assert names == [*RULES, *(r + s for s in suffixes[1:] for r in chosen), *(r + s for r in SPIFFY for s in suffixes)]
    oracle = report["oracle"]
    for row in report["rows"]:
        for key in ("accuracy", "nfe_mean", "nfe_over_oracle", "nfe_per_answer_token", "padding_share", "tpf", "tps"):
            assert isinstance(row[key], float), (row["name"], key)
        assert row["nfe_per_answer_token"] == pytest.approx(1 / row["tpf"])
        if row["speculation"]:  # lossless against its rule alone, and never below the rule's floor
            assert row["identical_to_commit_rule"] == 1.0
            alone = next(r for r in report["rows"] if r["name"] == row["name"].replace(
                "spiffy+frechet", f"frechet-{report['frechet_choice']['delta']:g}").replace("spiffy+", ""))
            assert row["spiffy_max_saving"] == pytest.approx(alone["nfe_mean"] / alone["spiffy_floor_nfe_mean"])
            assert row["nfe_mean"] >= alone["spiffy_floor_nfe_mean"]
        else:
            assert row["spiffy_ceiling"] == pytest.approx(row["nfe_mean"] / row["spiffy_floor_nfe_mean"])
        if oracle["reached_share"] == 1.0:
            assert row["nfe_over_oracle"] == pytest.approx(row["nfe_mean"] / oracle["nfe_mean"])
    assert {r["name"]: r["cache"] for r in report["rows"]}["spiffy+frechet/dual"] == "dual"
    assert report["rows"][names.index("spiffy+frechet/dual")]["params"]["spiffy"]["layout"] == "packed"


@pytest.mark.slow
def test_delta_choice_calibration_and_failfast_come_from_the_run(long_report, targets):
    root, report = long_report
    plain = {r["name"]: r for r in report["rows"] if r["cache"] == "none"}
    sweep = [plain["frechet-0"], plain["frechet-0.5"]]
    assert report["frechet_choice"] == targets.choose_delta(plain["threshold"], sweep)
    chosen = report["frechet_choice"]["delta"]
    assert plain["spiffy+frechet"]["params"]["frechet"] == {"delta": chosen}
    calibration = report["calibration"]
    assert set(calibration["graphs"]) == {"quota", "threshold", "factor", f"frechet-{chosen:g}"}
    for rule, graph in calibration["graphs"].items():
        assert graph["paths"] >= 150 and graph["prompts"] >= 2
        stored = json.loads(Path(graph["graph"]).read_text())
        assert stored["calibration"]["split"] == "train" and stored["calibration"]["paths"] == graph["paths"]
        points = [p for p in calibration["curve"] if p["rule"] == rule]
        assert points[-1]["paths"] == graph["paths"] and points[0]["target_paths"] == 20
        dual = {r["name"]: r for r in report["rows"] if r["cache"] == "dual"}  # the curve's cache: the last
        spiffy = dual[f"spiffy+{rule.split('-')[0]}/dual"]
        assert calibration["curve_cache"] == "dual"
        assert points[-1]["nfe_ratio"] == pytest.approx(dual[f"{rule}/dual"]["nfe_mean"] / spiffy["nfe_mean"])
        assert all(p["identical_to_commit_rule"] == 1.0 for p in points)
    methods = report["failfast"]["methods"]
    assert set(methods) == {"ar", "failfast@0.05", "failfast@0.9", "assisted"}
    ar = methods["ar"]
    assert ar["target_forwards"] == ar["generated_tokens"] + report["n"]  # a prefill, then one per token
    for name in ("failfast@0.05", "failfast@0.9", "assisted"):
        assert methods[name]["identical_to_ar"] == 1.0 and methods[name]["helper_forwards"] > 0
    best = report["failfast"]["best"]
    assert methods[best]["wall_seconds"] == min(methods[n]["wall_seconds"] for n in ("failfast@0.05", "failfast@0.9"))
    assert report["targets"] == targets.checklist(report)
    assert all(item["met"] in (True, False) for item in report["targets"])


@pytest.mark.slow
def test_the_long_page_shows_every_column_and_the_checklist(long_report, report_module):
    root, report = long_report
    page = (root / "docs" / "benchmarks" / "report.md").read_text()
    for header in ("| configuration | cache | accuracy | NFE | oracle NFE | NFE ÷ oracle | NFE / answer token "
                   "| padding share | tokens / forward | TPS | Spiffy could save at most | Spiffy saves |",
                   "## Fréchet's δ at matched accuracy", "## Spiffy's calibration", "## FailFast", "## Targets"):
        assert header in page
    for row in report["rows"]:
        assert f"| {row['label']} | {row['cache']} | {row['accuracy']:.1%} | {row['nfe_mean']:.2f} |" in page
    for item in report["targets"]:
        assert f"| {item['target']} | {item['measured']} |" in page
    assert f"**Chosen: δ = {report['frechet_choice']['delta']:g}**" in page
    for name in (*report_module.PLOTS.values(), report_module.CALIBRATION_PLOT):
        assert (root / "docs" / "assets" / name).read_bytes().startswith(b"\x89PNG")
    assert report_module.headline_table(report) in (root / "README.md").read_text()
    # the page follows the JSON: a changed figure changes the page
    changed = copy.deepcopy(report)
    changed["targets"][0]["measured"] = "12.3% at δ = 0.5"
    assert "| 12.3% at δ = 0.5 |" in report_module.report_page(changed, root / "report.json", None)


def test_the_full_matrix_and_failfast_on_the_toy_zoo(report_module, targets, tmp_path):
    """The smallest full run (one δ, no cache, the shipped toy models), its measurements made
    in two worker processes: in the default test run."""
    (tmp_path / "docs").mkdir()
    for name in ("README.md", "docs/index.md"):
        (tmp_path / name).write_text((ROOT / name).read_text())
    report_module.main([
        "--model", "toy-dllm", "--matrix", "full", "-n", "2", "--deltas", "0", "--caches", "none", "--calibration-paths", "20",
        "--calibration-sizes", "5", "--calibration-min-prompts", "1", "--target", "toy-ar",
        "--assistant", "toy-ar-small", "--drafter-taus", "0.5",
        "--out", str(tmp_path / "report.json"), "--docs", str(tmp_path / "docs"),
        "--readme", str(tmp_path / "README.md"), "--graphs", str(tmp_path / "graphs"), "--workers", "2",
        "--spiffy-budget", "4",
    ])
    report = json.loads((tmp_path / "report.json").read_text())
    measure = importlib.import_module("benchmarks.report_measure")  # a worker's row is the one made here
    here = measure.measure(load_model("toy-dllm"), measure.CONFIGS[1], select_examples("all", 2), 32)
    worker = next(r for r in report["rows"] if r["name"] == "threshold")
    assert (worker["nfe_mean"], worker["accuracy"], worker["tpf"]) == (here["nfe_mean"], here["accuracy"], here["tpf"])
    assert "--workers 2" in report["command"]
    assert (report["tasks"], report["matrix"]) == ("all", "full")
    assert [r["name"] for r in report["rows"]] == ["quota", "threshold", "factor", "frechet-0", *SPIFFY]
    assert all(r["identical_to_commit_rule"] == 1.0 for r in report["rows"] if r["speculation"])
    assert all(g["paths"] >= 20 and g["nodes"] == 4 for g in report["calibration"]["graphs"].values())
    assert report["calibration"]["budget"] == 4 and "--spiffy-budget 4" in report["command"]
    methods = report["failfast"]["methods"]
    assert [name for name in methods if name.startswith("failfast")] == ["failfast@0.5"]
    assert "--drafter-taus 0.5" in report["command"] and report["failfast"]["best"] == "failfast@0.5"
    ar, failfast = methods["ar"], methods["failfast@0.5"]
    assert ar["target_forwards"] == ar["generated_tokens"] + 2 and failfast["identical_to_ar"] == 1.0
    assert report["targets"] == targets.checklist(report)
    page = (tmp_path / "docs" / "benchmarks" / "report.md").read_text()
    assert "## Targets" in page and "## FailFast" in page and "**Chosen: δ = 0**" in page


def test_a_stopped_report_resumes_with_what_it_had_measured(report_module, tmp_path, monkeypatch):
    """Every finished measurement is kept at once; ``--resume`` reuses exactly those (rows,
    graphs, oracle) and measures the rest, and a changed input is measured again."""
    (tmp_path / "docs").mkdir()
    for name in ("README.md", "docs/index.md"):
        (tmp_path / name).write_text((ROOT / name).read_text())
    out = tmp_path / "report.json"
    args = ["--model", "toy-dllm", "--target", "none", "--matrix", "full", "-n", "2", "--deltas", "0", "--caches", "none", "--calibration-paths", "20",
            "--calibration-sizes", "5", "--calibration-min-prompts", "1", "--out", str(out),
            "--docs", str(tmp_path / "docs"), "--readme", str(tmp_path / "README.md"),
            "--graphs", str(tmp_path / "graphs")]
    jobs = importlib.import_module("benchmarks.report_jobs")  # where the measurements are made
    measure, calibrate, oracle = jobs.measure, jobs.calibrate_sizes, jobs.measure_oracle
    calls: list[str] = []

    def counted(name, original, stop_at=None):
        def call(*a, **k):
            calls.append(name)
            if stop_at is not None and calls.count(name) == stop_at:
                raise KeyboardInterrupt
            return original(*a, **k)
        return call

    def patch(stop_at=None):
        calls.clear()
        monkeypatch.setattr(jobs, "measure", counted("row", measure, stop_at))
        monkeypatch.setattr(jobs, "calibrate_sizes", counted("calibration", calibrate))
        monkeypatch.setattr(jobs, "measure_oracle", counted("oracle", oracle))

    patch(stop_at=3)  # Ctrl-C during the third row
    with pytest.raises(KeyboardInterrupt):
        report_module.main(args)
    store = out.with_suffix(report_module.STORE_SUFFIX)
    assert [json.loads(line)["name"] for line in store.read_text().splitlines()] == ["quota", "threshold"]
    assert not out.exists()

    patch()
    report_module.main([*args, "--resume"])
    resumed = json.loads(out.read_text())
    assert resumed["reused"] == ["quota", "threshold"]
    rows = len(resumed["rows"]) + len(resumed["calibration"]["curve"]) - len(resumed["calibration"]["graphs"])
    assert calls.count("row") == rows - 2 and calls.count("calibration") == 4 and calls.count("oracle") == 1
    assert "reused 2 measurements of the stopped run (quota, threshold)" in (tmp_path / "docs/benchmarks/report.md").read_text()

    patch()
    report_module.main([*args, "--resume"])  # everything is stored: nothing is measured
    again = json.loads(out.read_text())
    assert calls == [] and len(again["reused"]) == rows + 4 + 1
    assert [(r["name"], r["nfe_mean"], r["accuracy"]) for r in again["rows"]] == [
        (r["name"], r["nfe_mean"], r["accuracy"]) for r in resumed["rows"]]

    graphs = sorted((tmp_path / "graphs").rglob("threshold__paths*.json"))
    before = {path: path.read_bytes() for path in graphs}
    graphs[-1].write_text(graphs[-1].read_text().replace('"paths"', '"paths" ', 1))  # other bytes
    patch()
    report_module.main([*args, "--resume"])
    # threshold's graphs are made again; a row on a graph whose bytes differ from those it was
    # measured on is measured again, one on identical bytes is reused
    changed = sum(path.read_bytes() != before[path] for path in graphs)
    assert calls.count("calibration") == 1 and calls.count("row") == changed



def test_a_stored_measurement_is_keyed_by_its_run_its_settings_and_the_files_they_name(report_module, tmp_path):
    store_module = importlib.import_module("benchmarks.report_store")

    def get(store, kind, name, settings, compute, valid=None):  # as report_jobs.Runner reads and keeps
        key = store.key(kind, settings)
        found, value = store.lookup(key, name, valid)
        return value if found else store.put(key, name, compute())

    path, graph = tmp_path / "m.jsonl", tmp_path / "graph.json"
    graph.write_text("one")
    reopen = lambda identity={"weights": "w"}: store_module.MeasurementStore(path, identity, resume=True)
    first = store_module.MeasurementStore(path, {"weights": "w"})
    assert get(first, "row", "r", {"graph": str(graph)}, lambda: 1) == 1
    assert get(reopen(), "row", "r", {"graph": str(graph)}, lambda: 2) == 1  # reused
    assert get(reopen({"weights": "other"}), "row", "r", {"graph": str(graph)}, lambda: 3) == 3
    assert get(reopen(), "row", "r", {"graph": str(graph), "tau": 0.5}, lambda: 4) == 4
    graph.write_text("two")  # the same name, other contents
    assert get(reopen(), "row", "r", {"graph": str(graph)}, lambda: 5) == 5
    with path.open("a") as handle:
        handle.write('{"key": "cut sh')  # a line the interrupt cut short
    assert get(reopen(), "row", "r", {"graph": str(graph)}, lambda: 6) == 5
    assert get(reopen(), "row", "r", {"graph": str(graph)}, lambda: 7, valid=lambda value: value != 5) == 7
    assert get(reopen(), "row", "r", {"graph": str(graph)}, lambda: 9) == 7  # kept after the cut line
    assert get(store_module.MeasurementStore(path, {"weights": "w"}), "row", "r", {"graph": str(graph)}, lambda: 8) == 8
