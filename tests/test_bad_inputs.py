"""Every bad input of issue 21 answered clearly, before any work, never with a traceback.

``CASES`` is the whole matrix, one row per input: how it is given (the command line through
typer's ``CliRunner``, or the Python API), the exact dloom error (or warning) class, and the
words its message must contain. A command-line row must exit with status 2, print
``error: ...`` on stderr, nothing on stdout (refused before any decoding) and no traceback.
The behaviours that are not refusals (a bare string, streaming and Ctrl-C, guarantees,
batch sizes, progress, tables, the README's prompts) are tested after the matrix.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

import dloom
from dloom import cli
from dloom.cli import app
from dloom.errors import (
    ConfigurationError, HookContractError, ModelError, PluginLoadError, UnknownStrategyError,
)
from dloom_plugins.failfast import FailFastDecoder, build_failfast_decoder
from dloom_plugins.spiffy.graph import BUILTIN_DIR, MAX_NODES
from dloom.registry import check_plugin_class, get_registry, reset_registry
from dloom.zoo import model_path
from test_plugin_loading import FakeSite

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 57  # toy-dllm's vocabulary
QUOTA_B8_GRAPH = BUILTIN_DIR / "toy-dllm__quota__b8.json"


# --- the inputs ------------------------------------------------------------------------------


class Misspelt:
    @dloom.hookimpl
    def dloom_select_comit(self, confidence, selectable, schedule):
        return selectable


class ExtraArgument:
    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule, extra):
        return selectable


class Raises:
    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        raise RuntimeError("rule exploded")


class ReturnsList:
    @dloom.hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        return selectable.tolist()


MISSPELT_PLUGIN = """
    import dloom

    class Misspelt:
        @dloom.hookimpl
        def dloom_select_comit(self, confidence, selectable, schedule):
            return selectable

    @dloom.hookimpl
    def dloom_register_strategies(register):
        register(dloom.StrategyRegistration(name="misspelled", plugin_class=Misspelt))
"""


@dataclass
class Env:
    """What the rows need: files written once per test, the toy model, the fake site."""

    root: Path
    adapter: Any
    site: FakeSite
    monkeypatch: pytest.MonkeyPatch
    files: dict[str, Path] = field(default_factory=dict)

    def jsonl(self, name: str, lines: list[bytes]) -> str:
        path = self.root / name
        path.write_bytes(b"\n".join(lines) + b"\n")
        return str(path)

    def model_dir(self, name: str, change: Callable[[Path], None]) -> str:
        """A copy of toy-dllm, changed by ``change``."""
        path = self.root / name
        shutil.copytree(model_path("toy-dllm"), path)
        change(path)
        return str(path)

    def graph(self, name: str, change: Callable[[dict], None]) -> str:
        """The built-in quota / block-8 graph of toy-dllm, changed by ``change``."""
        data = json.loads(QUOTA_B8_GRAPH.read_text())
        change(data)
        path = self.root / name
        path.write_text(json.dumps(data))
        return str(path)

    def decoder(self, strategy: Any = "quota", **settings: Any) -> dloom.DiffusionDecoder:
        return dloom.DiffusionDecoder(self.adapter, strategy, **settings)

    def spiffy(self, graph_path: str) -> dloom.DiffusionDecoder:
        return self.decoder("spiffy", block_length=8, params={"spiffy.graph": graph_path})

    def install_misspelt(self) -> None:
        self.site.install("misspelled", MISSPELT_PLUGIN)


@dataclass(frozen=True)
class Case:
    """One row: ``make(env)`` gives the CLI arguments (``kind="cli"``) or a callable that
    makes the API call (``kind="api"``); ``error`` is the exact class raised (or warned)."""

    name: str
    kind: str
    make: Callable[[Env], Any]
    error: type
    words: tuple[str, ...]


def cli_case(name, make, error, *words) -> Case:
    return Case(name, "cli", make, error, words)


def api_case(name, make, error, *words) -> Case:
    return Case(name, "api", make, error, words)


def truncate(path: Path) -> None:
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200_000])


def corrupt_config(path: Path) -> None:
    (path / "config.json").write_text('{"model_type": "llama",, }')


def pickle_only(path: Path) -> None:
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")


def node(index: int, **change: Any) -> Callable[[dict], None]:
    return lambda data: data["nodes"][index - 1].update(change)


def extra_node(pairs: list[list[int]]) -> Callable[[dict], None]:
    """Add a leaf node under the root (the built-in graph has 10 nodes)."""

    def change(data: dict) -> None:
        data["nodes"].append({"id": len(data["nodes"]) + 1, "pairs": pairs, "parents": [0]})
        data["budget"] = len(data["nodes"])

    return change


def huge(data: dict) -> None:
    data["nodes"] = [{**data["nodes"][0], "id": i} for i in range(1, MAX_NODES + 2)]
    data["budget"] = len(data["nodes"])


def generate(*args: str) -> Callable[[Env], list[str]]:
    return lambda env: ["generate", *args]


LATE_LINES = [b'{"prompt": "copy ab"}'] * 16 + [b'{"prompt": "COPY AB"}']

CASES = [
    # 3. prompts and ids -----------------------------------------------------------------------
    cli_case("text outside the vocabulary", generate("COPY HELLO"), ModelError,
             "prompt 0", "'COPY HELLO'", "characters outside the vocabulary", "'C'", "'Y'"),
    cli_case("umlauts", generate("ÄÖÜ"), ModelError, "'Ä'", "'Ö'", "'Ü'", "outside the vocabulary"),
    cli_case("bad text on line 17 of 17",
             lambda env: ["generate", "--json", "--prompts", env.jsonl("late.jsonl", LATE_LINES)],
             ModelError, "late.jsonl:17", "'COPY AB'", "'C'"),
    cli_case("id 99999 in a file",
             lambda env: ["generate", "--prompts", env.jsonl("big.jsonl", [b'{"input_ids": [5, 99999]}'])],
             ModelError, "big.jsonl:1", "token id 99999", f"allowed: 0 .. {VOCAB - 1}"),
    cli_case("id -3 in a file",
             lambda env: ["generate", "--prompts", env.jsonl("neg.jsonl", [b'{"input_ids": [-3, 5]}'])],
             ModelError, "neg.jsonl:1", "token id -3 at position 0"),
    cli_case("float id in a file",
             lambda env: ["generate", "--prompts", env.jsonl("float.jsonl", [b'{"input_ids": [5, 6.7]}'])],
             ConfigurationError, "float.jsonl:1", "6.7 (float) at position 1", "integer token ids"),
    cli_case("bool id in a file",
             lambda env: ["generate", "--prompts", env.jsonl("bool.jsonl", [b'{"input_ids": [true, 5]}'])],
             ConfigurationError, "bool.jsonl:1", "True (bool)"),
    cli_case("non-UTF-8 JSONL",
             lambda env: ["generate", "--prompts", env.jsonl("latin.jsonl", [b'{"prompt": "copy \xe4b"}'])],
             ConfigurationError, "latin.jsonl:1", "not UTF-8", "0xe4"),
    cli_case("mask token id 9999", generate("--mask-token-id", "9999", "copy ab"), ModelError,
             "mask token id 9999", "outside the vocabulary", f"0 .. {VOCAB - 1}"),
    api_case("API: id 99999", lambda env: lambda: env.decoder().generate([[5, 99999]]), ModelError,
             "prompt 0", "token id 99999"),
    api_case("API: id -3", lambda env: lambda: env.decoder().generate([[5], [-3]]), ModelError,
             "prompt 1", "token id -3"),
    api_case("API: float id", lambda env: lambda: env.decoder().generate([[5, 6.0]]), ConfigurationError,
             "prompt 0", "6.0 (float)"),
    api_case("API: bool id", lambda env: lambda: env.decoder().generate([[5, False]]), ConfigurationError,
             "False (bool)"),
    api_case("API: float tensor", lambda env: lambda: env.decoder().generate(torch.tensor([[5.0, 6.0]])),
             ConfigurationError, "dtype torch.float32", "integer dtype"),
    api_case("API: tensor id 99999", lambda env: lambda: env.decoder().generate(torch.tensor([[5, 99999]])),
             ModelError, "prompt 0", "token id 99999 at position 1"),
    api_case("API: text outside the vocabulary", lambda env: lambda: env.decoder().generate(["COPY HELLO"]),
             ModelError, "'COPY HELLO'", "characters outside the vocabulary"),
    api_case("API: flat list of ids", lambda env: lambda: env.decoder().generate([5, 6, 7]),
             ConfigurationError, "prompt 0 is 5", "[[5, 6, 7]]"),
    api_case("API: mixed batch", lambda env: lambda: env.decoder().generate(["copy ab", [5, 6]]),
             ConfigurationError, "prompt 1 is token ids", "one kind per batch"),
    api_case("API: mask token id 9999",
             lambda env: lambda: dloom.DiffusionDecoder(dloom.load_model("toy-dllm", mask_token_id=9999)),
             ModelError, "mask token id 9999", "toy-dllm"),
    # 4. lengths of zero ------------------------------------------------------------------------
    cli_case("--gen-length 0", generate("--gen-length", "0", "copy ab"), ConfigurationError, "gen_length is 0"),
    cli_case("--block-length 0", generate("--block-length", "0", "copy ab"), ConfigurationError,
             "block_length is 0"),
    cli_case("--steps 0", generate("--steps", "0", "copy ab"), ConfigurationError, "steps is 0"),
    cli_case("failfast --gen-length 0", generate("--strategy", "failfast", "--gen-length", "0", "copy ab"),
             ConfigurationError, "gen_length is 0"),
    api_case("API: gen_length=0", lambda env: lambda: env.decoder(gen_length=0), ConfigurationError,
             "gen_length is 0", "positive integer"),
    api_case("API: block_length=0", lambda env: lambda: env.decoder(block_length=0), ConfigurationError,
             "block_length is 0"),
    api_case("API: steps=0", lambda env: lambda: env.decoder(steps=0), ConfigurationError, "steps is 0"),
    api_case("API: gen_length=8.0", lambda env: lambda: env.decoder(gen_length=8.0), ConfigurationError,
             "gen_length is 8.0"),
    api_case("API: static_shapes='yes'", lambda env: lambda: env.decoder(static_shapes="yes"), ConfigurationError,
             "static_shapes is 'yes'", "True or False"),
    api_case("API: FailFast max_new_tokens=0",
             lambda env: lambda: FailFastDecoder(
                 dloom.load_model("toy-ar", require_mask=False), env.adapter, max_new_tokens=0),
             ConfigurationError, "max_new_tokens is 0"),
    api_case("API: build_failfast_decoder gen_length=0",
             lambda env: lambda: build_failfast_decoder("toy-ar", "toy-dllm", gen_length=0),
             ConfigurationError, "gen_length is 0"),
    # 5. model files and devices ------------------------------------------------------------------
    cli_case("corrupt config.json",
             lambda env: ["generate", "--model", env.model_dir("badconfig", corrupt_config), "copy ab"],
             ModelError, "badconfig/config.json", "not valid JSON", "line 1"),
    cli_case("truncated safetensors",
             lambda env: ["generate", "--model", env.model_dir("truncated", truncate), "copy ab"],
             ModelError, "truncated/model.safetensors", "truncated"),
    cli_case("empty safetensors",
             lambda env: ["generate", "--model",
                          env.model_dir("empty", lambda p: (p / "model.safetensors").write_bytes(b"")), "copy ab"],
             ModelError, "empty/model.safetensors", "0 bytes"),
    cli_case("no weights",
             lambda env: ["generate", "--model",
                          env.model_dir("noweights", lambda p: (p / "model.safetensors").unlink()), "copy ab"],
             ModelError, "no weights in", "noweights", "model.safetensors"),
    cli_case("pickle .bin only",
             lambda env: ["generate", "--model", env.model_dir("pickled", pickle_only), "copy ab"],
             ModelError, "pytorch_model.bin", "pickle", "safetensors only"),
    api_case("API: load_model of a truncated checkpoint",
             lambda env: lambda: dloom.load_model(env.model_dir("truncated_api", truncate)),
             ModelError, "model.safetensors", "truncated"),
    pytest.param(
        cli_case("--device cuda without CUDA", generate("--device", "cuda", "copy ab"), ModelError,
                 "device 'cuda'", "no CUDA GPU", "--device cpu"),
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
        id="--device cuda without CUDA",
    ),
    cli_case("--device tpu9", generate("--device", "tpu9", "copy ab"), ModelError,
             "device 'tpu9'", "allowed: cpu, cuda"),
    cli_case("--device-map nonsense", generate("--device-map", "nonsense", "copy ab"), ModelError,
             "device_map 'nonsense'", "auto, balanced", "a device (cpu, cuda:N)"),
    api_case("API: device_map placing a module on a missing GPU",
             lambda env: lambda: dloom.load_model("toy-dllm", device_map={"": "cuda:7"}),
             ModelError, "device 'cuda:7'"),
    # 6. Spiffy graphs ----------------------------------------------------------------------------
    cli_case("graph rank beyond the vocabulary",
             lambda env: ["generate", "--strategy", "spiffy", "--block-length", "8",
                          "--graph", env.graph("vocab.json", extra_node([[0, 99999]])), "copy ab"],
             ConfigurationError, "vocab.json", "node 11 uses vocabulary rank 99999", f"{VOCAB} tokens"),
    api_case("graph rank beyond the block",
             lambda env: lambda: env.spiffy(env.graph("block.json", node(1, pairs=[[8, 0]]))),
             ConfigurationError, "node 1 has a position rank >= block_length 8"),
    api_case("graph temperature 'hot'",
             lambda env: lambda: env.spiffy(env.graph("hot.json", lambda d: d.update(temperature="hot"))),
             ConfigurationError, "'temperature' is 'hot'", "a number"),
    api_case("graph params as a list",
             lambda env: lambda: env.spiffy(env.graph("params.json", lambda d: d["base"].update(params=[]))),
             ConfigurationError, "'base.params' is []", "expected an object"),
    api_case("graph frequency 'x'",
             lambda env: lambda: env.spiffy(env.graph("freq.json", node(2, frequency="x"))),
             ConfigurationError, "node 2 'frequency' is 'x'"),
    api_case("graph id true",
             lambda env: lambda: env.spiffy(env.graph("id.json", node(1, id=True))),
             ConfigurationError, "node 1 'id' is True", "expected an integer"),
    api_case("graph float rank",
             lambda env: lambda: env.spiffy(env.graph("float.json", node(1, pairs=[[0, 0.5]]))),
             ConfigurationError, "node 1 vocabulary rank is 0.5"),
    api_case("graph of too many nodes",
             lambda env: lambda: env.spiffy(env.graph("huge.json", huge)),
             ConfigurationError, f"{MAX_NODES + 1} nodes", f"at most {MAX_NODES}"),
    # 7. plugin hooks -----------------------------------------------------------------------------
    api_case("misspelt hook", lambda env: lambda: check_plugin_class(Misspelt), PluginLoadError,
             "dloom_select_comit", "did you mean 'dloom_select_commit'"),
    api_case("hookimpl with an extra argument", lambda env: lambda: check_plugin_class(ExtraArgument),
             PluginLoadError, "dloom_select_commit", "'extra'"),
    api_case("misspelt plugin installed, strict",
             lambda env: lambda: (env.install_misspelt(), env.monkeypatch.setenv("DLOOM_STRICT_PLUGINS", "1"),
                                  get_registry()),
             PluginLoadError, "misspelled:misspelled", "dloom_select_comit", "DLOOM_STRICT_PLUGINS=1"),
    api_case("misspelt plugin installed: reported and skipped",
             lambda env: lambda: (env.install_misspelt(), get_registry()),
             RuntimeWarning, "'misspelled:misspelled' was skipped", "dloom_select_comit"),
    api_case("hook raises mid-decode", lambda env: lambda: env.decoder([Raises()]).generate([[5, 6]]),
             HookContractError, "plugin 'Raises'", "RuntimeError in dloom_select_commit", "rule exploded"),
    api_case("hook returns a list", lambda env: lambda: env.decoder([ReturnsList()]).generate([[5, 6]]),
             HookContractError, "plugin 'ReturnsList'", "returned a list from dloom_select_commit"),
    api_case("DLOOM_PLUGINS names an unknown plugin",
             lambda env: lambda: (env.monkeypatch.setenv("DLOOM_PLUGINS", "nosuchplugin"), get_registry()),
             RuntimeWarning, "DLOOM_PLUGINS names 'nosuchplugin'", "installed:"),
    # 8. options that would be ignored --------------------------------------------------------------
    cli_case("failfast with --model", generate("--strategy", "failfast", "--model", "/does/not/exist", "copy ab"),
             ConfigurationError, "--model /does/not/exist", "--target", "--drafter"),
    cli_case("failfast with an unknown drafter composition",
             generate("--strategy", "failfast", "--param", "drafter_strategy=spifyf+threshold", "copy ab"),
             UnknownStrategyError, "drafter_strategy 'spifyf+threshold'", "unknown strategy 'spifyf'",
             "Did you mean 'spiffy'?"),
    cli_case("failfast drafter_params item without a value",
             generate("--strategy", "failfast", "--param", "drafter_strategy=spiffy+threshold",
                      "--param", "drafter_params=spiffy.budget", "copy ab"),
             ConfigurationError, "drafter_params item 'spiffy.budget' is not NAME=VALUE", "spiffy.budget=4"),
    cli_case("threshold with --steps", generate("--strategy", "threshold", "--steps", "8", "copy ab"),
             ConfigurationError, "--steps 8 has no effect", "'threshold'"),
    api_case("Fréchet while sampling", lambda env: lambda: env.decoder("frechet", temperature=1.0),
             UserWarning, "bound frechet not certified under temperature 1", "what holds"),
    api_case("Fréchet with random remasking", lambda env: lambda: env.decoder("frechet", remasking="random"),
             UserWarning, "not certified under remasking 'random'"),
    # 9. calibrate ------------------------------------------------------------------------------------
    cli_case("calibrate -o into a missing directory",
             lambda env: ["calibrate", "-o", str(env.root / "nodir" / "x.json")],
             ConfigurationError, "nodir", "does not exist"),
    cli_case("calibrate -o an existing file",
             lambda env: ["calibrate", "-o", env.jsonl("exists.json", [b"{}"])],
             ConfigurationError, "exists.json exists", "--force"),
    cli_case("calibrate -o a directory", lambda env: ["calibrate", "-o", str(env.root)],
             ConfigurationError, "is a directory"),
    cli_case("calibrate failfast", lambda env: ["calibrate", "--strategy", "failfast", "-o", str(env.root / "g.json")],
             ConfigurationError, "'failfast'", "calibrate a commit rule"),
    # 10. memory ----------------------------------------------------------------------------------------
    cli_case("--max-batch-tokens below one sequence", generate("--max-batch-tokens", "4", "copy ab"),
             ConfigurationError, "--max-batch-tokens 4 is below one sequence"),
]


@pytest.fixture(scope="module")
def toy_adapter():
    return dloom.load_model("toy-dllm")


@pytest.fixture
def env(tmp_path, toy_adapter, site, monkeypatch):
    monkeypatch.delenv("DLOOM_PLUGINS", raising=False)
    monkeypatch.delenv("DLOOM_STRICT_PLUGINS", raising=False)
    yield Env(tmp_path, toy_adapter, site, monkeypatch)
    reset_registry()


@pytest.fixture
def site(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    reset_registry()
    fake = FakeSite(root)
    yield fake
    for module in fake.modules:
        sys.modules.pop(module, None)


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bad_input_is_refused_clearly(case: Case, env: Env, monkeypatch):
    if case.kind == "cli":
        raised: list[Exception] = []
        original = cli.fail
        monkeypatch.setattr(cli, "fail", lambda error: (raised.append(error), original(error)))
        monkeypatch.setattr(cli, "err_console", Console(stderr=True, width=10_000))  # no wrapping
        result = CliRunner().invoke(app, case.make(env))
        assert result.exit_code == 2, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        assert "Traceback" not in result.output and result.stdout == ""  # refused before decoding
        assert [type(e) for e in raised] == [case.error]
        message = flat(result.stderr)
        assert message.startswith("error:"), message
    elif issubclass(case.error, Warning):
        with pytest.warns(case.error) as caught:
            case.make(env)()
        matching = [str(w.message) for w in caught if w.category is case.error]
        message = next((m for m in matching if all(word in m for word in case.words)), matching[0])
    else:
        with pytest.raises(case.error) as caught:
            case.make(env)()
        assert type(caught.value) is case.error
        message = str(caught.value)
    for word in case.words:
        assert word in message, message


def test_the_matrix_covers_the_issue():
    """The closing note's count: every row is a distinct input."""
    names = [c.values[0].name if hasattr(c, "values") else c.name for c in CASES]
    assert len(names) == len(set(names)) == 66


# --- what is not a refusal -------------------------------------------------------------------


def test_a_bare_string_is_one_prompt(toy_adapter):
    decoder = dloom.DiffusionDecoder(toy_adapter, "quota")
    assert decoder.generate("copy ab").texts == decoder.generate(["copy ab"]).texts
    assert len(decoder.generate("copy ab").texts) == 1


def test_tensor_and_array_rows_are_prompts_of_ids(toy_adapter):
    import numpy as np

    decoder = dloom.DiffusionDecoder(toy_adapter, "quota")
    expected = decoder.generate([[5, 6]]).texts
    assert decoder.generate([torch.tensor([5, 6])]).texts == expected
    assert decoder.generate(np.array([[5, 6]])).texts == expected


def test_generate_json_writes_one_row_per_prompt_as_batches_finish(tmp_path, monkeypatch):
    written: list[int] = []
    original = cli.write_jsonl
    monkeypatch.setattr(cli, "write_jsonl", lambda rows: (written.append(len(rows)), original(rows)))
    result = CliRunner().invoke(app, ["generate", "--json", "--batch-size", "2", "copy ab", "copy cd", "copy ef"])
    assert result.exit_code == 0, result.output
    assert written == [2, 1]  # flushed per batch, not at the end
    assert [json.loads(line)["config"]["strategy"] for line in result.stdout.splitlines()] == ["quota"] * 3


def test_eval_interrupted_by_sigint_keeps_the_finished_rows_and_a_summary(tmp_path):
    command = [sys.executable, "-c", "import sys; from dloom.cli import app; sys.argv[0] = 'dloom'; app()", "eval", "-n", "200", "--batch-size", "2", "--json",
               "--strategy", "quota"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "stderr", "w") as errors:
        # A shell's background job inherits SIGINT ignored, and Python then installs no handler
        # for it: the child gets the default disposition back, as a terminal's command has.
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True, env=env,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        first = process.stdout.readline()  # the first batch has finished and was flushed
        process.send_signal(signal.SIGINT)
        rest = process.stdout.read()  # through the same buffer as readline
        process.wait(timeout=120)
    stderr = (tmp_path / "stderr").read_text()
    *rows, summary = [json.loads(line) for line in [first, *rest.splitlines()] if line.strip()]
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted:" in stderr
    assert 2 <= len(rows) < 200 and all({"family", "prompt", "text", "correct"} <= set(r) for r in rows)
    assert summary["complete"] is False and summary["n"] == len(rows)
    assert summary["accuracy"] == sum(r["correct"] for r in rows) / len(rows)


def fail_on_third_batch(monkeypatch, finished: int = 0) -> None:
    """Make the third ``DiffusionDecoder.generate`` call (counting ``finished`` as made) raise,
    as a device error would."""
    original, calls = dloom.DiffusionDecoder.generate, [finished]

    def generate(decoder, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("out of memory on the third batch")
        return original(decoder, *args, **kwargs)

    monkeypatch.setattr(dloom.DiffusionDecoder, "generate", generate)


def test_an_error_in_a_later_eval_batch_keeps_the_finished_batches(toy_adapter, monkeypatch):
    from dloom.evaluation import EvaluationFailed, evaluate, select_examples

    fail_on_third_batch(monkeypatch)
    examples = select_examples("all", 10, 0)
    with pytest.raises(EvaluationFailed, match="stopped after 4 examples: RuntimeError: out of memory") as caught:
        evaluate(dloom.DiffusionDecoder(toy_adapter, "quota"), examples, batch_size=2, progress=False)
    partial = caught.value.partial
    assert partial.complete is False and partial.n == 4
    assert [o["prompt"] for o in partial.outputs] == [e.prompt for e in examples[:4]]
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_an_error_before_any_eval_batch_finished_is_raised_as_itself(toy_adapter, monkeypatch):
    from dloom.evaluation import evaluate, select_examples

    fail_on_third_batch(monkeypatch, finished=2)
    with pytest.raises(RuntimeError, match="out of memory"):
        evaluate(dloom.DiffusionDecoder(toy_adapter, "quota"), select_examples("all", 4, 0), batch_size=2,
                 progress=False)


def test_eval_json_after_an_error_in_a_later_batch_keeps_the_rows_and_a_summary(monkeypatch):
    fail_on_third_batch(monkeypatch)
    monkeypatch.setattr(cli, "err_console", Console(stderr=True, width=10_000))
    result = CliRunner().invoke(app, ["eval", "-n", "10", "--batch-size", "2", "--json", "--strategy", "quota"])
    assert result.exit_code == 2, result.output
    *rows, summary = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 4 and summary["complete"] is False and summary["n"] == 4
    assert "Traceback" not in result.stderr
    assert "error: stopped after 4 examples: RuntimeError: out of memory on the third batch" in flat(result.stderr)


def test_demo_runs_with_a_broken_plugin_installed(site, monkeypatch):
    site.install("misspelled", MISSPELT_PLUGIN)
    with pytest.warns(RuntimeWarning, match="'misspelled:misspelled' was skipped"):
        result = CliRunner().invoke(app, ["demo", "-n", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert "misspelled" not in {row["strategy"] for row in json.loads(result.stdout)["rows"]}
    reset_registry()


def test_guarantee_records_what_holds(toy_adapter):
    with pytest.warns(UserWarning, match="not certified"):
        sampled = dloom.DiffusionDecoder(toy_adapter, "frechet", temperature=1.0, seed=0)
    result = sampled.generate(["copy ab"])
    assert result.config["guarantees"]["frechet"].startswith("bound frechet not certified")
    greedy = dloom.DiffusionDecoder(toy_adapter, "frechet").generate(["copy ab"])
    assert greedy.config["guarantees"]["frechet"] == get_registry().get("frechet").guarantee


def test_batch_size_is_fitted_to_max_batch_tokens_and_said():
    result = CliRunner().invoke(app, ["generate", "--json", "--batch-size", "8", "--max-batch-tokens", "90",
                                      "copy ab", "copy cd", "copy ef"])
    assert result.exit_code == 0, result.output
    assert "batch size 8 -> 2" in flat(result.stderr) and "--max-batch-tokens 90" in flat(result.stderr)
    assert len(result.stdout.splitlines()) == 3


def test_the_memory_budget_caps_a_huge_batch(toy_adapter):
    from dloom.batching import plan_batch_size

    plan = plan_batch_size(toy_adapter, 100_000, 48)
    assert 1 <= plan.size < 100_000 and plan.size * 48 * plan.bytes_per_token <= 2 * 1024**3
    assert "memory budget of 2.0 GiB" in plan.note(48)


def test_calibrate_force_overwrites(tmp_path):
    out = tmp_path / "g.json"
    out.write_text("old")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "copy ab"}\n{"prompt": "copy cd"}\n')
    args = ["calibrate", "--block-length", "8", "--budget", "2", "--prompts", str(prompts), "-o", str(out)]
    assert CliRunner().invoke(app, args).exit_code == 2 and out.read_text() == "old"
    result = CliRunner().invoke(app, [*args, "--force"])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["format"] == "dloom-draft-graph"


def test_check_shows_progress():
    result = CliRunner().invoke(app, ["check", "--strategy", "frechet"])
    assert result.exit_code == 0, result.output
    assert re.search(r"\d+\.\ds soundness of frechet", flat(result.stderr))


def test_spiffy_suggests_a_calibrate_command_that_runs(toy_adapter, tmp_path):
    with pytest.warns(UserWarning, match="dloom calibrate") as caught:
        dloom.DiffusionDecoder(toy_adapter, "spiffy", block_length=16)
    command = re.search(r"`(dloom calibrate [^`]+)`", str(caught[0].message)).group(1)
    args = command.split()[1:]
    assert args[args.index("-o") + 1] == "graph.json"
    args[args.index("-o") + 1] = str(tmp_path / "graph.json")
    result = CliRunner().invoke(app, [*args, "-n", "4"])
    assert result.exit_code == 0, result.output
    from dloom.check.tiny import tiny_dllm

    in_memory = tiny_dllm(0)
    with pytest.warns(UserWarning, match="built in memory, so it cannot be calibrated by name"):
        dloom.DiffusionDecoder(in_memory, "spiffy", gen_length=8, block_length=8)


def test_cli_warnings_point_at_the_caller_not_typer():
    with pytest.warns(UserWarning, match="uncalibrated default graph") as caught:
        CliRunner().invoke(app, ["generate", "--strategy", "spiffy", "--block-length", "16", "copy ab"])
    assert caught[0].filename == __file__


def test_tables_keep_strategy_names_whole_at_80_columns(monkeypatch, site):
    site.install("longname", """
        import dloom
        from dloom_plugins.baselines import ThresholdCommit

        @dloom.hookimpl
        def dloom_register_strategies(register):
            register(dloom.StrategyRegistration(
                name="a-rather-long-strategy-name", plugin_class=ThresholdCommit,
                parameters=(dloom.Parameter("tau", 0.9, float, "threshold", low=0.0, high=1.0),),
                guarantee="none at all, spelled out at some length to push the table wide",
            ))
    """)
    monkeypatch.setattr(cli, "console", Console(width=80, record=True))
    result = CliRunner().invoke(app, ["strategies"])
    assert result.exit_code == 0, result.output
    text = cli.console.export_text()
    for name in [*get_registry().strategies, "a-rather-long-strategy-name"]:
        assert re.search(rf"\b{re.escape(name)}\b", text), text
    reset_registry()


def test_readme_showcase_prompts_are_answered_right(toy_adapter):
    from dloom.zoo.tasks import FAMILIES

    commands = {"copy": "copy", "sort": "sort", "add": "add", "rev": "reverse"}
    prompts = set(re.findall(r'"((?:copy|sort|add|rev) [^"]+)"', (ROOT / "README.md").read_text()))
    assert prompts, "the README shows no task prompt"
    texts = dloom.DiffusionDecoder(toy_adapter, "threshold", tau=0.9).generate(sorted(prompts)).texts
    for prompt, text in zip(sorted(prompts), texts):
        assert FAMILIES[commands[prompt.split()[0]]].check(prompt, text), (prompt, text)
    failfast = build_failfast_decoder("toy-ar", "toy-dllm")
    for prompt in re.findall(r'--drafter toy-dllm "([^"]+)"', (ROOT / "README.md").read_text()):
        text = failfast.generate([prompt]).texts[0]
        assert FAMILIES[commands[prompt.split()[0]]].check(prompt, text), (prompt, text)


def test_toy_showcase_prompts_check_catches_a_wrong_prompt(toy_adapter):
    """The README check above would fail on the old prompt ("sort 5391" is outside the
    trained lengths)."""
    from dloom.zoo.tasks import FAMILIES

    text = dloom.DiffusionDecoder(toy_adapter, "threshold", tau=0.9).generate(["sort 5391"]).texts[0]
    assert not FAMILIES["sort"].check("sort 5391", text)

