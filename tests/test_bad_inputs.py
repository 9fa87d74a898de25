"""Every bad input of issues 21 and 41 answered clearly, before any work, never with a traceback.

``CASES`` is the whole matrix, one row per input: how it is given (the command line through
typer's ``CliRunner``, or the Python API), the exact dloom error (or warning) class, and the
words its message must contain. A command-line row must exit with status 2, print
``error: ...`` on stderr, nothing on stdout (refused before any decoding) and no traceback.
The behaviours that are not refusals (a bare string, streaming and Ctrl-C, guarantees,
batch sizes, progress, tables, the README's prompts) are tested after the matrix, and so
are the ends of a real ``dloom`` process (issue 41): Ctrl-C while it starts (status 130),
results it cannot write (status 74), Ray's messages kept off stdout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

import dloom
from conftest import FakeSite
from dloom.cli import commands as cli
from dloom.cli import exits as cli_exits
from dloom.cli.commands import app
from dloom.errors import (
    ConfigurationError,
    HookContractError,
    ModelError,
    PluginLoadError,
    UnknownStrategyError,
)
from dloom.hooks.registry import check_plugin_class, get_registry, reset_registry
from dloom.zoo import model_path
from dloom_plugins.failfast import FailFastDecoder, build_failfast_decoder
from dloom_plugins.spiffy.graph import BUILTIN_DIR, MAX_NODES

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 57  # toy-dllm's vocabulary
QUOTA_B8_GRAPH = BUILTIN_DIR / "toy-dllm__quota__b8.json"
REAL_FAMILIES = ROOT / "tests" / "fixtures" / "real-families"


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

    def family_dir(self, family: str, name: str, change: Callable[[Path], None]) -> str:
        """A copy of the tiny real-format checkpoint of ``family``, changed by ``change``."""
        path = self.root / name
        shutil.copytree(REAL_FAMILIES / family / "checkpoint", path)
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


def set_config(**values: Any) -> Callable[[Path], None]:
    """Set ``values`` in a checkpoint's config.json."""

    def change(path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **values}))

    return change


def write(name: str, text: str) -> Callable[[Path], None]:
    return lambda path: (path / name).write_text(text)


def change_tensors(change: Callable[[dict], None]) -> Callable[[Path], None]:
    """Rewrite model.safetensors with ``change`` applied to its tensors."""
    from safetensors.torch import load_file, save_file

    def apply(path: Path) -> None:
        tensors = load_file(path / "model.safetensors")
        change(tensors)
        save_file(tensors, path / "model.safetensors")

    return apply


UP_0 = "model.layers.0.mlp.up_proj.weight"


def lying_header(path: Path) -> None:
    """Halve the first tensor's shape in the safetensors header, keeping its byte range."""
    data = (path / "model.safetensors").read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    first = next(name for name in header if name != "__metadata__")
    header[first]["shape"][0] //= 2
    text = json.dumps(header, separators=(",", ":")).encode()
    (path / "model.safetensors").write_bytes(data[:8] + text.ljust(size) + data[8 + size :])


def set_section(**values: Any) -> Callable[[Path], None]:
    """Set ``values`` in the ``dloom`` section of a checkpoint's config.json."""

    def change(path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "dloom": {**config["dloom"], **values}}))

    return change


def long_integer(path: Path) -> None:
    """vocab_size written as an integer of 5,000 digits (Python refuses to parse it)."""
    text = (path / "config.json").read_text()
    (path / "config.json").write_text(re.sub(r'"vocab_size": \d+', '"vocab_size": ' + "9" * 5000, text))


def sparse_tokenizer(path: Path) -> None:
    """tokenizer.json grown to 600 MB of holes (no disk used)."""
    os.truncate(path / "tokenizer.json", 600 * 1024 * 1024)


def overlapping_tensors(path: Path) -> None:
    """Give up_proj of layer 0 the byte range of gate_proj (same shape), in the header."""
    data = (path / "model.safetensors").read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    gate = header["model.layers.0.mlp.gate_proj.weight"]["data_offsets"]
    header[UP_0]["data_offsets"] = gate
    text = json.dumps(header, separators=(",", ":")).encode()
    (path / "model.safetensors").write_bytes(data[:8] + text.ljust(size) + data[8 + size :])


def chat_template(template: str) -> Callable[[Path], None]:
    """Give the checkpoint's tokenizer the chat template ``template``."""

    def change(path: Path) -> None:
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))

    return change


def trailing_bytes(path: Path) -> None:
    """Append 6 bytes that no tensor covers."""
    with open(path / "model.safetensors", "ab") as weights:
        weights.write(b"\0" * 6)


def gap_before_last(path: Path) -> None:
    """Move the last tensor's byte range 2 bytes on (and grow the file by 2), leaving 2 bytes
    before it unused."""
    data = (path / "model.safetensors").read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    last = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])
    header[last]["data_offsets"] = [offset + 2 for offset in header[last]["data_offsets"]]
    text = json.dumps(header, separators=(",", ":")).encode()
    (path / "model.safetensors").write_bytes(data[:8] + text.ljust(size) + data[8 + size :] + b"\0\0")


def replace_with(make: Callable[[Path], None]) -> Callable[[Path], None]:
    """Remove the copied checkpoint and put what ``make`` creates at its path."""
    return lambda path: (shutil.rmtree(path), make(path))


def symlink_loop(name: str) -> Callable[[Path], None]:
    def change(path: Path) -> None:
        (path / name).unlink()
        (path / name).symlink_to(path / name)

    return change


def plugin_raising(where: str, error: str) -> str:
    """A plugin source that raises ``error`` (a statement) at import or in its registration."""
    if where == "import":
        return f"import sys\n{error}\n"
    return f"import sys, dloom\n\n@dloom.hookimpl\ndef dloom_register_strategies(register):\n    {error}\n"


def install_raising(env: Env, where: str, error: str, strict: bool = False) -> Callable[[], Any]:
    def call() -> Any:
        env.site.install("hostile", plugin_raising(where, error))
        if strict:
            env.monkeypatch.setenv("DLOOM_STRICT_PLUGINS", "1")
        return get_registry()

    return call


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
    cli_case("prompt line nested 100000 deep",
             lambda env: ["generate", "--prompts", env.jsonl("nested.jsonl", [b"[" * 100_000 + b"]" * 100_000])],
             ConfigurationError, "nested.jsonl:1", "nests JSON too deeply"),
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
    cli_case("a prompt of mask tokens only (issue 55)",
             lambda env: ["generate", "--prompts", env.jsonl("masks.jsonl", [b'{"input_ids": [5, 6]}', b'{"input_ids": [1, 1, 1]}'])],
             ConfigurationError, "masks.jsonl:2", "made only of the mask token (id 1)", "at least one other token"),
    api_case("API: a prompt of mask tokens only (issue 55)",
             lambda env: lambda: env.decoder().generate([[5, 6, 7, 8], [1, 1, 1]]),
             ConfigurationError, "prompt 1 is made only of the mask token (id 1)"),
    api_case("API: a padded tensor row of mask tokens only (issue 55)",
             lambda env: lambda: env.decoder().generate(
                 torch.tensor([[5, 6, 7, 8], [0, 1, 1, 1]]), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])),
             ConfigurationError, "prompt 1 is made only of the mask token (id 1)"),
    api_case("API: text outside the vocabulary", lambda env: lambda: env.decoder().generate(["COPY HELLO"]),
             ModelError, "'COPY HELLO'", "characters outside the vocabulary"),
    api_case("API: flat list of ids", lambda env: lambda: env.decoder().generate([5, 6, 7]),
             ConfigurationError, "prompt 0 is 5", "[[5, 6, 7]]"),
    api_case("API: mixed batch", lambda env: lambda: env.decoder().generate(["copy ab", [5, 6]]),
             ConfigurationError, "prompt 1 is token ids", "one kind per batch"),
    api_case("API: mask token id 9999",
             lambda env: lambda: dloom.DiffusionDecoder(dloom.load_model("toy-dllm", mask_token_id=9999)),
             ModelError, "mask token id 9999", "toy-dllm"),
    # issue 55: one bound on cache_refresh for every surface (requests: tests/serve) -------------
    cli_case("generate --cache-refresh 10**21", generate("--cache", "prefix", "--cache-refresh", str(10**21), "copy ab"),
             ConfigurationError, f"cache_refresh is {10**21}; allowed: at most 1048576"),
    cli_case("serve --cache-refresh 10**21", lambda env: ["serve", "--cache", "prefix", "--cache-refresh", str(10**21)],
             ConfigurationError, f"cache_refresh is {10**21}; allowed: at most 1048576"),
    api_case("API: cache_refresh 10**21", lambda env: lambda: env.decoder(cache="prefix", cache_refresh=10**21),
             ConfigurationError, f"cache_refresh is {10**21}; allowed: at most 1048576"),
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
    # 5b. hostile checkpoints (issue 41) ----------------------------------------------------------
    cli_case("Llama checkpoint missing a tensor",
             lambda env: ["generate", "--model", env.model_dir("missing", change_tensors(lambda t: t.pop(UP_0))),
                          "copy ab"],
             ModelError, "tensor names do not match the llama model", "tensors it needs that the checkpoint "
             f"lacks: '{UP_0}'"),
    cli_case("Llama checkpoint with an int8 tensor",
             lambda env: ["generate", "--model", env.model_dir(
                 "int8", change_tensors(lambda t: t.update({UP_0: t[UP_0].to(torch.int8)}))), "copy ab"],
             ModelError, f"'{UP_0}' is I8, the model's is floating point", "allowed: F64, F32, F16, BF16"),
    api_case("API: missing tensor with trust_remote_code=True (no code to trust)",
             lambda env: lambda: dloom.load_model(
                 env.model_dir("missing_trusted", change_tensors(lambda t: t.pop(UP_0))), trust_remote_code=True),
             ModelError, f"tensors it needs that the checkpoint lacks: '{UP_0}'"),
    api_case("API: tensor of another shape",
             lambda env: lambda: dloom.load_model(env.model_dir(
                 "shape", change_tensors(lambda t: t.update({UP_0: t[UP_0][:100]})))),
             ModelError, f"'{UP_0}' has shape [100, 192], the model's [512, 192]"),
    api_case("API: tensor with no place in the model",
             lambda env: lambda: dloom.load_model(env.model_dir(
                 "extra", change_tensors(lambda t: t.update({"model.layers.9.mlp.up_proj.weight": t[UP_0].clone()})))),
             ModelError, "tensors with no place in it: 'model.layers.9.mlp.up_proj.weight'"),
    cli_case("config.json nested 100000 deep",
             lambda env: ["generate", "--model", env.model_dir("bomb", write("config.json", "[" * 100_000 + "]" * 100_000)),
                          "copy ab"],
             ModelError, "bomb/config.json", "nests JSON deeper than 32 levels"),
    api_case("API: config.json nested 40 deep",
             lambda env: lambda: dloom.load_model(env.model_dir(
                 "deep", write("config.json", '{"a": ' + "[" * 40 + "]" * 40 + "}"))),
             ModelError, "deep/config.json", "nests JSON deeper than 32 levels"),
    cli_case("config.json not an object",
             lambda env: ["generate", "--model", env.model_dir("alist", write("config.json", "[1, 2]")), "copy ab"],
             ModelError, "alist/config.json", "holds a JSON list; expected an object"),
    cli_case("hidden_size a string",
             lambda env: ["generate", "--model", env.model_dir("hstr", set_config(hidden_size="192")), "copy ab"],
             ModelError, "hstr/config.json", "hidden_size is '192' (str); allowed: an integer 1 .. 65536"),
    api_case("API: num_attention_heads 0",
             lambda env: lambda: dloom.load_model(env.model_dir("heads0", set_config(num_attention_heads=0))),
             ModelError, "num_attention_heads is 0; allowed: an integer 1 .. 4096"),
    api_case("API: vocab_size -1",
             lambda env: lambda: dloom.load_model(env.model_dir("vneg", set_config(vocab_size=-1))),
             ModelError, "vocab_size is -1; allowed: an integer 1 .. 4194304"),
    api_case("API: vocab_size a float",
             lambda env: lambda: dloom.load_model(env.model_dir("vfloat", set_config(vocab_size=57.0))),
             ModelError, "vocab_size is 57.0 (float)"),
    api_case("API: hidden_size not divisible by the heads",
             lambda env: lambda: dloom.load_model(env.model_dir("ndiv", set_config(hidden_size=190, head_dim=None))),
             ModelError, "hidden_size 190 is not divisible by num_attention_heads 6"),
    cli_case("num_hidden_layers 1000000",
             lambda env: ["generate", "--model", env.model_dir("layers", set_config(num_hidden_layers=1_000_000)),
                          "copy ab"],
             ModelError, "num_hidden_layers is 1000000; allowed: an integer 1 .. 1024"),
    api_case("API: num_hidden_layers 200 with the weights of 4",
             lambda env: lambda: dloom.load_model(env.model_dir("layers200", set_config(num_hidden_layers=200))),
             ModelError, "num_hidden_layers is 200", "at least 54,078,144 parameters",
             "the checkpoint's tensors hold 3,564,288 bytes"),
    api_case("API: safetensors header lying about a size",
             lambda env: lambda: dloom.load_model(env.model_dir("lying", lying_header)),
             ModelError, "lying/model.safetensors", "lies about tensor 'model.embed_tokens.weight'",
             "shape [28, 192] of F16 takes 10752 bytes"),
    cli_case("tokenizer.json not JSON",
             lambda env: ["generate", "--model", env.model_dir("tokjson", write("tokenizer.json", '{"model": ')),
                          "copy ab"],
             ModelError, "tokjson/tokenizer.json", "not valid JSON", "line 1, column 11"),
    api_case("API: tokenizer.json of no tokenizer",
             lambda env: lambda: dloom.load_model(env.model_dir(
                 "tokbad", write("tokenizer.json", '{"model": {"type": "WordLevel", "vocab": 5}}'))),
             ModelError, "the tokenizer files in", "tokbad", "do not make a tokenizer"),
    cli_case("no tokenizer, text prompt",
             lambda env: ["generate", "--model", env.model_dir("notok", lambda p: [
                 (p / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")]),
                 "copy ab"],
             ModelError, "has no tokenizer", "pass token ids instead of text"),
    cli_case("generation_config.json not JSON",
             lambda env: ["generate", "--model", env.model_dir("genjson", write("generation_config.json", "{")),
                          "copy ab"],
             ModelError, "genjson/generation_config.json", "not valid JSON"),
    api_case("API: generation_config.json eos_token_id a string",
             lambda env: lambda: dloom.load_model(env.model_dir(
                 "geneos", write("generation_config.json", '{"eos_token_id": "x"}'))),
             ModelError, "geneos/generation_config.json", "eos_token_id is 'x'", "allowed: a token id"),
    cli_case("empty directory",
             lambda env: ["generate", "--model", env.model_dir("emptydir", replace_with(Path.mkdir)), "copy ab"],
             ModelError, "no config.json in", "emptydir"),
    cli_case("a file instead of a directory",
             lambda env: ["generate", "--model", env.model_dir("afile", replace_with(lambda p: p.write_text("x"))),
                          "copy ab"],
             ModelError, "no model directory at", "afile"),
    cli_case("config.json a symlink loop",
             lambda env: ["generate", "--model", env.model_dir("cfgloop", symlink_loop("config.json")), "copy ab"],
             ModelError, "cannot read", "cfgloop/config.json", "Too many levels of symbolic links"),
    api_case("API: model.safetensors a symlink loop",
             lambda env: lambda: dloom.load_model(env.model_dir("weightloop", symlink_loop("model.safetensors"))),
             ModelError, "cannot read weights file", "weightloop/model.safetensors", "symbolic links"),
    api_case("API: the dloom section a list",
             lambda env: lambda: dloom.load_model(env.model_dir("dlist", set_config(dloom=[1]))),
             ModelError, "dloom is [1]; allowed: a JSON object"),
    # 5c. malformed checkpoint fields (issue 55), each refused before the model is built -----------
    cli_case("rms_norm_eps a string",
             lambda env: ["generate", "--model", env.model_dir("eps", set_config(rms_norm_eps="abc")), "copy ab"],
             ModelError, "eps/config.json", "rms_norm_eps is 'abc' (str); allowed: a finite number > 0 and <= 1"),
    api_case("API: tie_word_embeddings 'yes'",
             lambda env: lambda: dloom.load_model(env.model_dir("tie", set_config(tie_word_embeddings="yes"))),
             ModelError, "tie_word_embeddings is 'yes' (str); allowed: true or false"),
    api_case("API: hidden_act 'evil'",
             lambda env: lambda: dloom.load_model(env.model_dir("act", set_config(hidden_act="evil"))),
             ModelError, "hidden_act is 'evil'; allowed: gelu,", "silu"),
    api_case("API: rope_type 'evil'",
             lambda env: lambda: dloom.load_model(env.model_dir(
                 "ropetype", set_config(rope_parameters={"rope_type": "evil", "rope_theta": 10000.0}))),
             ModelError, "rope_parameters.rope_type is 'evil'; allowed: default, dynamic, linear"),
    api_case("API: head_dim 7",
             lambda env: lambda: dloom.load_model(env.model_dir("hd7", set_config(head_dim=7))),
             ModelError, "head_dim is 7: RoPE rotates pairs of dimensions; allowed: an even rotary dimension"),
    cli_case("pad_token_id 99999",
             lambda env: ["generate", "--model", env.model_dir("pad", set_config(pad_token_id=99999)), "copy ab"],
             ModelError, "pad/config.json", f"pad_token_id is 99999; allowed: a token id 0 .. {VOCAB - 1}"),
    cli_case("an integer of 5,000 digits",
             lambda env: ["generate", "--model", env.model_dir("longint", long_integer), "copy ab"],
             ModelError, "longint/config.json", "vocab_size is an integer of 5000 digits; allowed: at most 64 digits"),
    cli_case("generation_config.json nested 100000 deep",
             lambda env: ["generate", "--model", env.model_dir(
                 "genbomb", write("generation_config.json", "[" * 100_000 + "]" * 100_000)), "copy ab"],
             ModelError, "genbomb/generation_config.json", "nests JSON deeper than 32 levels"),
    api_case("API: vocab.json nested 100000 deep",
             lambda env: lambda: dloom.load_model(env.model_dir(
                 "vocabbomb", write("vocab.json", "[" * 100_000 + "]" * 100_000))),
             ModelError, "vocabbomb/vocab.json", "nests JSON deeper than 32 levels"),
    api_case("API: a sparse 600 MB tokenizer.json",
             lambda env: lambda: dloom.load_model(env.model_dir("sparsetok", sparse_tokenizer)),
             ModelError, "sparsetok/tokenizer.json", "is larger than 536870912 bytes; allowed: up to 536870912"),
    api_case("API: tensors whose byte ranges overlap",
             lambda env: lambda: dloom.load_model(env.model_dir("overlap", overlapping_tensors)),
             ModelError, "overlap/model.safetensors", f"gives tensor '{UP_0}' bytes 218880 .. 415488",
             "overlap tensor 'model.layers.0.mlp.gate_proj.weight'", "without overlap or gap"),
    api_case("API: bytes after the last tensor",
             lambda env: lambda: dloom.load_model(env.model_dir("trailing", trailing_bytes)),
             ModelError, "trailing/model.safetensors", "holds 6 bytes after its last tensor"),
    api_case("API: unused bytes between tensors",
             lambda env: lambda: dloom.load_model(env.model_dir("gap", gap_before_last)),
             ModelError, "gap/model.safetensors", "unused; allowed: byte ranges that follow one another"),
    cli_case("dloom.block_length 0",
             lambda env: ["generate", "--model", env.model_dir("block0", set_section(block_length=0)), "copy ab"],
             ModelError, "block0/config.json", "dloom.block_length is 0; allowed: an integer 1 .. 65536"),
    api_case("API: dloom.shift 'maybe'",
             lambda env: lambda: dloom.load_model(env.model_dir("shift", set_section(shift="maybe"))),
             ModelError, "dloom.shift is 'maybe' (str); allowed: true, false"),
    api_case("API: LLaDA weight_tying 'yes' (the same checks for every family)",
             lambda env: lambda: dloom.load_model(env.family_dir("llada", "lladatie", set_config(weight_tying="yes"))),
             ModelError, "lladatie/config.json", "weight_tying is 'yes' (str); allowed: true or false (or null)"),
    api_case("API: LLaDA2 rms_norm_eps a string",
             lambda env: lambda: dloom.load_model(env.family_dir("llada2", "llada2eps", set_config(rms_norm_eps="abc"))),
             ModelError, "llada2eps/config.json", "rms_norm_eps is 'abc' (str)"),
    # 5d. chat templates on the command line, refused as the server refuses them (issue 55) ----------
    cli_case("--chat with a template that raises",
             lambda env: ["generate", "--chat", "--model", env.model_dir(
                 "raising", chat_template("{{ raise_exception('no user turns here') }}")), "copy ab"],
             ModelError, "the model's chat template refused the conversation: no user turns here"),
    cli_case("--chat with a template of broken syntax",
             lambda env: ["generate", "--chat", "--model", env.model_dir("syntax", chat_template("{% if %}")), "copy ab"],
             ModelError, "the model's chat template refused the conversation:", "Expected an expression"),
    cli_case("--chat with an unsafe template",
             lambda env: ["generate", "--chat", "--model", env.model_dir(
                 "unsafe", chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}")), "copy ab"],
             ModelError, "the model's chat template refused the conversation:", "access to attribute '__class__'",
             "is unsafe"),
    # 7b. hostile plugins (issue 41) ----------------------------------------------------------------
    api_case("plugin calling sys.exit() at import: reported and skipped",
             lambda env: install_raising(env, "import", "sys.exit(3)"),
             RuntimeWarning, "'hostile' was skipped: SystemExit: 3"),
    api_case("plugin raising KeyboardInterrupt at import: reported and skipped",
             lambda env: install_raising(env, "import", "raise KeyboardInterrupt"),
             RuntimeWarning, "'hostile' was skipped: KeyboardInterrupt"),
    api_case("plugin calling sys.exit() in its registration: reported and skipped",
             lambda env: install_raising(env, "register", "sys.exit('no')"),
             RuntimeWarning, "'hostile' was skipped: SystemExit: no"),
    api_case("plugin raising GeneratorExit in its registration: reported and skipped",
             lambda env: install_raising(env, "register", "raise GeneratorExit('gone')"),
             RuntimeWarning, "'hostile' was skipped: GeneratorExit: gone"),
    api_case("plugin calling sys.exit() at import, strict",
             lambda env: install_raising(env, "import", "sys.exit(3)", strict=True),
             PluginLoadError, "dloom plugin 'hostile' was skipped: SystemExit: 3", "DLOOM_STRICT_PLUGINS=1"),
    api_case("plugin raising KeyboardInterrupt in its registration, strict",
             lambda env: install_raising(env, "register", "raise KeyboardInterrupt", strict=True),
             PluginLoadError, "dloom plugin 'hostile'", "KeyboardInterrupt"),
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
    assert len(names) == len(set(names)) == 125


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
    monkeypatch.setattr(cli, "write_jsonl", lambda rows, out=None: (written.append(len(rows)), original(rows, out)))
    result = CliRunner().invoke(app, ["generate", "--json", "--batch-size", "2", "copy ab", "copy cd", "copy ef"])
    assert result.exit_code == 0, result.output
    assert written == [2, 1]  # flushed per batch, not at the end
    assert [json.loads(line)["config"]["strategy"] for line in result.stdout.splitlines()] == ["quota"] * 3


def test_eval_interrupted_by_sigint_keeps_the_finished_rows_and_a_summary(tmp_path):
    command = [sys.executable, "-c", "import sys; from dloom.cli.commands import app; sys.argv[0] = 'dloom'; app()", "eval", "-n", "200", "--batch-size", "2", "--json",
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
    from dloom.errors import EvaluationFailed
    from dloom.evaluation import evaluate, select_examples

    fail_on_third_batch(monkeypatch)
    examples = select_examples("all", 10, 0)
    with pytest.raises(EvaluationFailed, match="stopped after 4 examples: RuntimeError: out of memory") as caught:
        evaluate(dloom.DiffusionDecoder(toy_adapter, "quota"), examples, batch_size=2)
    partial = caught.value.partial
    assert partial.complete is False and partial.n == 4
    assert [o["prompt"] for o in partial.outputs] == [e.prompt for e in examples[:4]]
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_an_error_before_any_eval_batch_finished_is_raised_as_itself(toy_adapter, monkeypatch):
    from dloom.evaluation import evaluate, select_examples

    fail_on_third_batch(monkeypatch, finished=2)
    with pytest.raises(RuntimeError, match="out of memory"):
        evaluate(dloom.DiffusionDecoder(toy_adapter, "quota"), select_examples("all", 4, 0), batch_size=2)


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
    from dloom.decode.batching import plan_batch_size

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


# --- issue 41: the ends of a real `dloom` process ----------------------------------------------


def test_a_plugin_exiting_at_import_does_not_stop_the_command(site):
    """``sys.exit()`` in a third-party plugin made every command exit 1; it is skipped."""
    site.install("hostile", plugin_raising("import", "sys.exit(1)"))
    with pytest.warns(RuntimeWarning, match="'hostile' was skipped: SystemExit: 1"):
        result = CliRunner().invoke(app, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    listing = json.loads(result.stdout)
    assert listing["failures"] == [{"name": "hostile", "error": "SystemExit: 1"}]
    assert {"baselines", "spiffy"} <= {p["name"] for p in listing["plugins"]}
    reset_registry()


def test_a_plugin_exiting_while_declaring_commands_does_not_stop_the_command(site):
    site.install("hostile", """
        import sys, dloom

        @dloom.hookimpl
        def dloom_register_commands(cli):
            sys.exit(4)
    """)
    with pytest.warns(RuntimeWarning, match=r"'hostile \(dloom_register_commands\)' was skipped: SystemExit: 4"):
        result = CliRunner().invoke(app, ["--help"])  # lists the core's and the plugins' commands
    assert result.exit_code == 0, result.output
    assert "generate" in result.stdout and "strategies" in result.stdout
    reset_registry()


def test_an_absurd_layer_count_is_refused_in_well_under_a_second(tmp_path):
    """``num_hidden_layers: 1000000`` hung for minutes building layers."""
    import time

    directory = tmp_path / "layers"
    shutil.copytree(model_path("toy-dllm"), directory)
    set_config(num_hidden_layers=1_000_000)(directory)
    started = time.perf_counter()
    with pytest.raises(ModelError, match="num_hidden_layers is 1000000; allowed: an integer 1 .. 1024"):
        dloom.load_model(directory)
    assert time.perf_counter() - started < 1.0


def test_a_sparse_600_mb_tokenizer_is_refused_by_its_size_before_any_read(tmp_path, toy_adapter):
    """It was read up to 512 MB before the refusal (peak 915 MB); now its size refuses it,
    and the load (its imports done by ``toy_adapter``) allocates a few megabytes on the way."""
    import time
    import tracemalloc

    directory = tmp_path / "sparse"
    shutil.copytree(model_path("toy-dllm"), directory)
    sparse_tokenizer(directory)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ModelError, match="tokenizer.json' is larger than 536870912 bytes"):
            dloom.load_model(directory)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024 * 1024, peak  # the 16 MB read buffer of config.json is gone too
    assert time.perf_counter() - started < 5.0


DLOOM_SCRIPT = """import sys
from dloom.cli.commands import app
if __name__ == '__main__':
    sys.exit(app())
"""
"""What pip writes as the ``dloom`` console script (``[project.scripts]``)."""


def dloom_command(tmp_path: Path) -> list[str]:
    """The ``dloom`` console script run by this interpreter (its file is named ``dloom``,
    as the installed one is)."""
    script = tmp_path / "bin" / "dloom"
    script.parent.mkdir(exist_ok=True)
    script.write_text(DLOOM_SCRIPT)
    return [sys.executable, str(script)]


def child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}


@pytest.mark.parametrize("delay", [0.2, 0.5, 1.0, 1.5])
def test_ctrl_c_while_starting_exits_130_with_one_line(tmp_path, delay):
    """SIGINT while ``dloom eval`` imports torch, loads plugins or loads the model: status
    130 and one line, never a traceback."""
    import time

    process = subprocess.Popen(
        [*dloom_command(tmp_path), "eval", "-n", "4", "--json"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=child_env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    seen = f"stderr {stderr!r}, stdout {stdout[-2000:]!r}"
    assert process.returncode == 130, seen
    assert "Traceback" not in stderr and stderr.count("interrupted") == 1, seen
    assert len(stderr.strip().splitlines()) == 1, seen
    assert stdout == "", seen


def eval_into(tmp_path: Path, stdout: Any, **popen: Any) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*dloom_command(tmp_path), "eval", "-n", "6", "--batch-size", "2", "--json", "--outputs"],
        stdout=stdout, stderr=subprocess.PIPE, text=True, env=child_env(), timeout=300, **popen,
    )


def test_a_full_disk_gives_a_clear_error_and_status_74(tmp_path):
    """ENOSPC on stdout ended in a traceback."""
    with open("/dev/full", "w") as full:
        run = eval_into(tmp_path, full)
    assert run.returncode == cli_exits.EXIT_OUTPUT_ERROR == 74, run.stderr
    assert "Traceback" not in run.stderr
    assert "error: cannot write the results to stdout (/dev/full): No space left on device" in flat(run.stderr)


def test_a_file_over_its_size_limit_gives_a_clear_error_and_keeps_what_was_written(tmp_path):
    """EFBIG on stdout exited 0 with a truncated summary."""
    import resource

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write() instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))  # the whole output is ~2 kB

    out = tmp_path / "out.jsonl"
    with open(out, "w") as handle:
        run = eval_into(tmp_path, handle, preexec_fn=limit_file_size)
    assert run.returncode == 74, run.stderr
    assert "Traceback" not in run.stderr
    assert f"error: cannot write the results to stdout ({out}): File too large" in flat(run.stderr)
    written = out.read_bytes()
    assert len(written) == 1000  # everything up to the limit is kept
    first = json.loads(written.splitlines()[0])
    assert {"family", "prompt", "text"} <= set(first)


def test_ray_messages_printed_while_ray_runs_go_to_stderr(capsys):
    """Ray's driver prints its raylet's messages ("(raylet) A worker died ...") to
    ``sys.stdout`` from a listener thread; while ``dloom eval --ray`` runs they go to stderr,
    and the JSON lines, written to the stream taken before, stay alone on stdout."""
    pytest.importorskip("ray", reason="the Ray tests need the optional extra")
    from ray._private.worker import print_to_stdstream

    from dloom.ray.batch import driver_prints_to_stderr

    stream = cli.JsonlStream(sys.stdout)
    with driver_prints_to_stderr():
        print_to_stdstream({"lines": ["A worker died or was killed while executing a task"],
                            "pid": "raylet", "is_err": False}, ignore_prefix=False)
        stream([{"row": 1}])
    captured = capsys.readouterr()
    assert captured.out == '{"row": 1}\n'
    assert "(raylet)" in captured.err and "A worker died" in captured.err


def descendants(pid: int) -> dict[int, str]:
    """The command lines of every process below ``pid`` (read from /proc), by process id."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
    below, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - below
        below |= frontier
    return {p: commands[p] for p in below if p in commands}


def test_eval_on_ray_keeps_stdout_json_when_an_actor_dies(tmp_path):
    """Killing the decoding actor mid-run makes Ray's driver print "(raylet) A worker died
    ..." (to ``sys.stdout``): it lands on stderr, stdout holds JSON lines only, and the run
    finishes on the restarted actor."""
    pytest.importorskip("ray", reason="the Ray tests need the optional extra")
    with open(tmp_path / "stderr", "w") as errors:
        process = subprocess.Popen(
            [*dloom_command(tmp_path), "eval", "-n", "40", "--batch-size", "2", "--ray", "1", "--json"],
            stdout=subprocess.PIPE, stderr=errors, text=True, env=child_env(),
        )
        first = process.stdout.readline()  # the actor is decoding
        actors = [p for p, command in descendants(process.pid).items() if command.startswith("ray::MapWorker")]
        assert actors, descendants(process.pid)
        os.kill(actors[0], signal.SIGKILL)
        rest = process.stdout.read()  # through the same buffer as readline
        process.wait(timeout=300)
    stderr = (tmp_path / "stderr").read_text()
    assert process.returncode == 0, stderr
    assert "(raylet)" in stderr and "A worker died or was killed" in stderr
    lines = [first, *rest.splitlines()]
    records = [json.loads(line) for line in lines]  # every stdout line is JSON
    assert len(records) == 41 and records[-1]["n"] == 40


def test_a_saved_rope_buffer_of_any_shape_loads_as_transformers_drops_it(tmp_path):
    """Old checkpoints saved RoPE's ``inv_freq``; transformers skips it on load, so the
    tensor check does not weigh its shape."""
    directory = tmp_path / "inv_freq"
    shutil.copytree(model_path("toy-dllm"), directory)
    change_tensors(lambda t: t.update({"model.rotary_emb.inv_freq": torch.zeros(3)}))(directory)
    assert dloom.load_model(directory).profile == "transformers"
