"""The ``dloom`` command line: strategies, plugins, generate, and its error exits."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from conftest import MASK_ID
from dloom.cli import commands as cli
from dloom.cli.commands import app


@pytest.fixture(autouse=True)
def wide_consoles(monkeypatch):
    """Rich wraps at 80 columns when not on a terminal; tests read whole lines."""
    monkeypatch.setattr(cli, "console", Console(width=400))
    monkeypatch.setattr(cli, "err_console", Console(width=400, stderr=True))


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def flat(text: str) -> str:
    return " ".join(text.split())


def write_jsonl(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    return write_jsonl(
        tmp_path / "prompts.jsonl",
        json.dumps({"input_ids": [5, 6, 7]}),
        "",
        json.dumps({"input_ids": [8, 9]}),
    )


def generate_args(model_dir: Path, prompts: Path, *extra: str) -> list[str]:
    return [
        "generate", "--model", str(model_dir), "--prompts", str(prompts), "--json",
        "--gen-length", "8", "--block-length", "4", *extra,
    ]


# --- strategies and plugins --------------------------------------------------------------


def test_strategies_json_lists_builtins_with_parameters_and_guarantees():
    result = invoke("strategies", "--json")
    assert result.exit_code == 0, result.output
    records = {r["name"]: r for r in json.loads(result.stdout)}
    assert {"factor", "frechet", "quota", "spiffy", "threshold"} <= set(records)
    assert list(records) == sorted(records)
    threshold = records["threshold"]
    assert threshold["plugin"] == "baselines"
    assert threshold["hooks"] == ["dloom_select_commit"]
    assert threshold["parameters"] == [
        {
            "name": "tau", "default": 0.7, "type": "float", "allowed": "(0, 1)",
            "help": "commit positions whose confidence exceeds tau",
        }
    ]
    assert records["factor"]["parameters"][0]["allowed"] == "(0, inf)"
    assert records["quota"]["parameters"] == []
    for record in records.values():
        assert record["guarantee"], record["name"]
        assert record["summary"], record["name"]
    assert records["quota"]["guarantee"].startswith("reference kernel")


def test_strategies_table():
    result = invoke("strategies")
    assert result.exit_code == 0, result.output
    assert "tau=0.7 (0, 1)" in result.stdout
    assert "f=1.0 (0, inf)" in result.stdout
    for name in ("quota", "threshold", "factor"):
        assert name in result.stdout


def test_plugins_table_mentions_baselines_and_its_hooks():
    result = invoke("plugins")
    assert result.exit_code == 0, result.output
    line = next(row for row in result.stdout.splitlines() if "baselines" in row)
    assert "(third party)" not in line
    assert "0.1.0" in line
    assert "dloom_register_strategies, dloom_select_commit" in line
    assert "quota, dream, threshold, factor" in line
    assert result.stderr == ""


def test_plugins_json():
    result = invoke("plugins", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report == {
        "plugins": [
            {
                "name": "families", "version": "0.1.0", "builtin": True,
                "hooks": ["dloom_register_families"], "strategies": [],
            },
            {
                "name": "baselines", "version": "0.1.0", "builtin": True,
                "hooks": ["dloom_register_strategies", "dloom_select_commit"],
                "strategies": ["quota", "dream", "threshold", "factor", "joint_threshold", "wino", "entropy_bound"],
            },
            {
                "name": "failfast", "version": "0.1.0", "builtin": True,
                "hooks": [
                    "dloom_build_mask", "dloom_configure", "dloom_draft", "dloom_prune",
                    "dloom_register_strategies", "dloom_verify",
                ],
                "strategies": ["failfast"],
            },
            {
                "name": "frechet", "version": "0.1.0", "builtin": True,
                "hooks": ["dloom_register_strategies", "dloom_select_commit"],
                "strategies": ["frechet", "frechet_edit"],
            },
            {
                "name": "spiffy", "version": "0.1.0", "builtin": True,
                "hooks": [
                    "dloom_build_mask", "dloom_configure", "dloom_draft", "dloom_prune",
                    "dloom_register_commands", "dloom_register_strategies", "dloom_verify",
                ],
                "strategies": ["spiffy"],
            },
        ],
        "failures": [],
    }


def test_no_arguments_shows_help():
    result = invoke()
    assert "generate" in result.output and "plugins" in result.output and "strategies" in result.output


# --- generate ----------------------------------------------------------------------------


def test_generate_json_one_object_per_prompt(tiny_model_dir, prompts_file):
    result = invoke(*generate_args(tiny_model_dir, prompts_file, "--strategy", "threshold", "--param", "tau=0.8"))
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert set(row) == {"text", "tokens", "nfe", "tpf", "tps", "speculation", "config"}
        assert row["speculation"] is None
        assert row["text"] is None  # the checkpoint has no tokenizer
        assert 1 <= len(row["tokens"]) <= 8
        assert MASK_ID not in row["tokens"]
        assert 2 <= row["nfe"] <= 8  # two blocks, at least one forward each
        assert row["tpf"] == pytest.approx(len(row["tokens"]) / row["nfe"])
        assert row["tps"] > 0
        config = row["config"]
        assert config["strategy"] == "threshold"
        assert config["params"] == {"threshold": {"tau": 0.8}}
        assert config["model"] == str(tiny_model_dir)
        assert (config["gen_length"], config["block_length"], config["steps"]) == (8, 4, 8)
        assert config["temperature"] == 0.0
        assert config["dtype"] == "float32"


def test_generate_matches_the_python_api(tiny_model_dir, prompts_file):
    from dloom import DiffusionDecoder, load_model

    result = invoke(*generate_args(tiny_model_dir, prompts_file, "--strategy", "threshold", "--param", "threshold.tau=0.8"))
    assert result.exit_code == 0, result.output
    cli_tokens = [json.loads(line)["tokens"] for line in result.stdout.splitlines()]
    decoder = DiffusionDecoder(load_model(tiny_model_dir), "threshold", tau=0.8, gen_length=8, block_length=4)
    assert cli_tokens == decoder.generate([[5, 6, 7], [8, 9]]).token_lists


def test_generate_table(tiny_model_dir, prompts_file):
    args = generate_args(tiny_model_dir, prompts_file)
    args.remove("--json")
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "NFE" in result.stdout and "TPF" in result.stdout and "TPS" in result.stdout


def test_generate_defaults_to_quota(tiny_model_dir, prompts_file):
    result = invoke(*generate_args(tiny_model_dir, prompts_file))
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert {r["config"]["strategy"] for r in rows} == {"quota"}
    # one token per step: a row needs at least as many forwards as tokens up to its EOS
    assert all(len(r["tokens"]) <= r["nfe"] <= 8 for r in rows)
    assert all(r["tpf"] <= 1.0 for r in rows)


HOOK_SWAP = "spiffy+quota+threshold@select_commit"  # threshold's commit rule replaces quota's


@pytest.mark.filterwarnings("ignore:no built-in draft graph")  # an uncalibrated graph still drafts
def test_generate_takes_a_hook_swap(tiny_model_dir, prompts_file):
    """``NAME@HOOK`` in ``--strategy`` runs, with the tokens of the composition it amounts to."""
    swapped, plain = (
        invoke(*generate_args(tiny_model_dir, prompts_file, "--strategy", spec, "--param", "tau=0.8", "--budget", "10"))
        for spec in (HOOK_SWAP, "spiffy+threshold")
    )
    assert swapped.exit_code == plain.exit_code == 0, swapped.output
    rows = [json.loads(line) for line in swapped.stdout.splitlines()]
    assert {r["config"]["strategy"] for r in rows} == {HOOK_SWAP}
    assert [r["tokens"] for r in rows] == [json.loads(line)["tokens"] for line in plain.stdout.splitlines()]


@pytest.mark.filterwarnings("ignore:no built-in draft graph")
def test_eval_takes_a_hook_swap():
    def summary(spec: str) -> dict:
        result = invoke("eval", "--strategy", spec, "-n", "4", "--budget", "10", "--json", "--outputs")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.splitlines()[-1])

    swapped, plain = summary(HOOK_SWAP), summary("spiffy+threshold")
    assert swapped["config"]["strategy"] == HOOK_SWAP
    assert swapped["outputs"] == plain["outputs"] and swapped["accuracy"] == plain["accuracy"]


def test_a_malformed_hook_swap_exits_2(tiny_model_dir, prompts_file):
    result = invoke(*generate_args(tiny_model_dir, prompts_file, "--strategy", "quota+threshold@nohook"))
    assert_usage_error(result, "cannot replace 'nohook'")


def assert_usage_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    message = flat(result.stderr)
    assert message.startswith("error:"), message
    for fragment in fragments:
        assert fragment in message, message
    assert "Traceback" not in result.output
    assert result.stdout == ""


def test_generate_unknown_strategy_exits_2(tiny_model_dir, prompts_file):
    result = invoke(*generate_args(tiny_model_dir, prompts_file, "--strategy", "treshold"))
    assert_usage_error(result, "unknown strategy 'treshold'", "Did you mean 'threshold'?")


def test_generate_out_of_range_param_exits_2(tiny_model_dir, prompts_file):
    result = invoke(*generate_args(tiny_model_dir, prompts_file, "--strategy", "threshold", "--param", "tau=2"))
    assert_usage_error(result, "parameter 'tau' of strategy 'threshold' is 2.0; allowed: (0, 1)")


def test_generate_param_without_value_exits_2(tiny_model_dir, prompts_file):
    result = invoke(*generate_args(tiny_model_dir, prompts_file, "--strategy", "threshold", "--param", "bogus"))
    assert_usage_error(result, "--param takes NAME=VALUE, got 'bogus'")


def test_generate_unknown_param_exits_2(tiny_model_dir, prompts_file):
    result = invoke(*generate_args(tiny_model_dir, prompts_file, "--strategy", "threshold", "--param", "bogus=1"))
    assert_usage_error(result, "unknown parameter 'bogus'", "allowed: tau (threshold)")


def test_generate_block_not_dividing_gen_length_exits_2(tiny_model_dir, prompts_file):
    args = generate_args(tiny_model_dir, prompts_file)
    args[args.index("--gen-length") + 1] = "10"
    result = invoke(*args)
    assert_usage_error(result, "gen_length 10 is not a multiple of block_length 4")


def test_generate_malformed_jsonl_exits_2(tiny_model_dir, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", json.dumps({"input_ids": [5]}), "{not json")
    result = invoke(*generate_args(tiny_model_dir, bad))
    assert_usage_error(result, "bad.jsonl:2 is not valid JSON")


def test_generate_jsonl_line_without_prompt_exits_2(tiny_model_dir, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", json.dumps({"text": "hi"}))
    result = invoke(*generate_args(tiny_model_dir, bad))
    assert_usage_error(result, 'bad.jsonl:1 needs a "prompt" string or an "input_ids" list')


def test_generate_text_prompt_without_tokenizer_exits_2(tiny_model_dir):
    result = invoke(
        "generate", "copy abc", "--model", tiny_model_dir, "--gen-length", "8", "--block-length", "4"
    )
    assert_usage_error(result, "has no tokenizer; pass token ids instead of text")


def test_generate_missing_model_directory_exits_2(tmp_path, prompts_file):
    missing = tmp_path / "no-such-model"
    result = invoke(*generate_args(missing, prompts_file))
    assert result.exit_code == 2, result.output
    assert "no model directory at" in flat(result.stderr)
    assert "dloom loads local checkpoints only" in flat(result.stderr)
    assert "no-such-model" in "".join(result.stderr.split())


def test_generate_without_prompts_exits_2(tiny_model_dir):
    result = invoke("generate", "--model", tiny_model_dir)
    assert_usage_error(result, "no prompts")


def test_generate_prompts_and_arguments_together_exits_2(tiny_model_dir, prompts_file):
    result = invoke(*generate_args(tiny_model_dir, prompts_file), "copy abc")
    assert_usage_error(result, "not both")


def test_generate_error_message_is_not_rich_markup(tiny_model_dir, prompts_file):
    result = invoke(*generate_args(tiny_model_dir, prompts_file, "--strategy", "threshold", "--param", "tau=[/x]"))
    assert_usage_error(result, "got '[/x]'")


# --- the installed console script --------------------------------------------------------


def test_console_script_runs():
    exe = shutil.which("dloom")
    assert exe, "the dloom console script is not installed"
    done = subprocess.run([exe, "strategies"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "threshold" in done.stdout


# --- what the core reads off registrations, never off names -------------------------------


def test_help_lists_the_plugin_owned_command_and_options(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.setenv("TERMINAL_WIDTH", "300")
    assert "calibrate" in flat(invoke("--help").output)  # spiffy's dloom_register_commands
    listing = flat(invoke("generate", "--help").output)
    for flag, text in [("--graph", "spiffy: draft-graph file"), ("--budget", "spiffy: D*"),
                       ("--layout", "spiffy: drafts as batch rows")]:
        assert flag in listing and text in listing
    assert "--budget" in flat(invoke("calibrate", "--help").output)  # calibrate's own: D nodes


def test_the_decoder_kind_comes_from_the_registration():
    from dloom.decode.decoders import AR_TARGET, DIFFUSION, decoder_kind
    from dloom.errors import UnknownStrategyError
    from dloom.hooks.registry import get_registry

    assert get_registry().get("failfast").registration.decoder == AR_TARGET
    assert decoder_kind("failfast") == AR_TARGET
    assert decoder_kind("spiffy+quota") == decoder_kind("threshold") == DIFFUSION
    assert decoder_kind(object()) == DIFFUSION
    with pytest.raises(UnknownStrategyError, match="'nosuch'"):
        decoder_kind("quota+nosuch")


def test_build_decoder_dispatches_on_the_registration_not_the_name(monkeypatch):
    import dataclasses

    from dloom import factory
    from dloom.hooks.registry import Strategy, get_registry

    registry = get_registry()
    failfast = registry.get("failfast")
    renamed = dataclasses.replace(failfast.registration, name="chains")
    monkeypatch.setitem(registry.strategies, "chains", Strategy("chains", failfast.plugin, renamed))
    built = []
    monkeypatch.setitem(factory.DECODER_BUILDERS, "ar-target", lambda *a, **k: built.append(a[1]) or "ar")
    assert factory.build_decoder(None, "chains", ["tau=0.5"]) == "ar" and built == ["chains"]
    result = invoke("generate", "x", "--strategy", "quota", "--target", "t")
    assert result.exit_code == 2
    assert "--target and --drafter apply to --strategy chains or failfast only" in flat(result.output)


def test_every_decoder_follows_the_decoder_protocol(tiny_adapter):
    from dloom import ARTargetDecoder, DiffusionDecoder
    from dloom.check import tiny
    from dloom.decode.decoders import ComposedDecoder, Decoder

    diffusion = DiffusionDecoder(tiny_adapter, "threshold", gen_length=8, block_length=8)
    assert isinstance(diffusion, Decoder) and isinstance(diffusion, ComposedDecoder)
    assert diffusion.name == "threshold" and diffusion.totals() is None
    target, drafter = tiny.tiny_ar(0, vocab=8), tiny.tiny_dllm(0, vocab=8)
    ar = ARTargetDecoder(target, "failfast", drafter=drafter, params={"n_max": 4, "initial_length": 2}, max_new_tokens=4)
    assert isinstance(ar, Decoder) and isinstance(ar, ComposedDecoder)
    assert ar.name == "failfast" and ar.config["gen_length"] == 4
    ar.generate([[1, 2]])
    assert ar.totals()["rows"] == 1
