"""Static shapes (``DiffusionDecoder(static_shapes=True)``, ``dloom.cache.static_view``).

For a fixed set of rows every forward of a kind keeps its shapes across steps and blocks
(full forwards ``(R, L)``, cached windows ``(R, W)``, a record preallocated once and written
in place), so that a compiled model reuses its graphs. The tokens and NFE are those of the
default path on the toy zoo; cached logits agree up to float rounding.
"""

from __future__ import annotations

import functools

import pytest
import torch
from typer.testing import CliRunner

from dloom import DiffusionDecoder, load_model
from dloom.cache import _static_layer
from dloom.cli import app
from dloom.zoo.tasks import held_out

STRATEGIES = ["quota", "threshold", "frechet", "spiffy+threshold"]
MODES = ["none", "prefix", "dual"]
LONG = ["story leo shy hen", "story bob shy cat", "copy ab", "story tom shy cow"]


@pytest.fixture(scope="module")
def toy():
    return load_model("toy-dllm")


@pytest.fixture(scope="module")
def prompts():
    return [e.prompt for e in held_out(6)] + LONG[:2]


def decoded(decoder: DiffusionDecoder, prompts, batch: int):
    """Every prompt's tokens and NFE, decoding ``batch`` prompts at a time."""
    tokens, nfe = [], []
    for i in range(0, len(prompts), batch):
        result = decoder.generate(prompts[i : i + batch])
        tokens += result.token_lists
        nfe += result.nfe.tolist()
    return tokens, nfe


def same_decoding(toy, prompts, strategy: str, mode: str, batch: int) -> None:
    settings = dict(cache=mode, block_length=4)
    default = decoded(DiffusionDecoder(toy, strategy, **settings), prompts, batch)
    static = decoded(DiffusionDecoder(toy, strategy, static_shapes=True, **settings), prompts, batch)
    assert static == default, (strategy, mode, batch)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_static_shapes_decode_the_default_tokens_and_nfe(toy, prompts, strategy, mode):
    """Greedy tokens and per-prompt NFE identical to the default path on eight zoo prompts
    in one batch (rows at different blocks, rows leaving)."""
    same_decoding(toy, prompts, strategy, mode, len(prompts))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_static_shapes_decode_the_default_tokens_and_nfe_one_at_a_time(toy, prompts, strategy, mode):
    same_decoding(toy, prompts, strategy, mode, 1)


def step_logits(toy, prompts, mode: str, static: bool) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    decoder = DiffusionDecoder(toy, "quota", cache=mode, block_length=4, static_shapes=static)
    decoder.generate(prompts, observer=lambda record: seen.append(record.logits.clone()))
    return seen


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_cached_logits_agree_up_to_rounding_and_a_stale_window_is_caught(toy, mode, monkeypatch):
    """Full forwards give bit-identical logits, cached ones agree within 1e-4 (the same keys
    and values in another order). Negative control: a window that attends to the record
    without writing its own keys there (stale block-start keys) is far off."""
    default = step_logits(toy, LONG, mode, False)
    static = step_logits(toy, LONG, mode, True)
    gaps = [float((a - b).abs().max()) for a, b in zip(default, static, strict=True)]
    assert gaps[0] == 0  # the first step is a full forward of every row
    assert max(gaps) < 1e-4 and any(gap > 0 for gap in gaps)  # cached steps ran on the static record

    layer = _static_layer()
    monkeypatch.setattr(layer, "update", lambda self, k, v, *a, **kw: (self.keys, self.values))
    stale = step_logits(toy, LONG, mode, True)
    assert max(float((a - b).abs().max()) for a, b in zip(default, stale)) > 1e-2


def forward_shapes(toy, prompts, mode: str, static: bool):
    """The ``(rows, columns)`` of every model call over a decode, and the record's buffers."""
    shapes: list[tuple[int, int]] = []
    inner = toy.model.forward

    @functools.wraps(inner)
    def counting(*args, **kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return inner(*args, **kwargs)

    toy.model.forward = counting
    try:
        decoder = DiffusionDecoder(toy, "quota", cache=mode, block_length=4, static_shapes=static)
        decoder.generate(prompts)
    finally:
        del toy.model.forward
    return shapes


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_of_one_runs_at_most_two_shapes_over_seven_blocks(toy, mode):
    """One prompt decoded over seven blocks (its answer ends in the seventh): with static
    shapes one full-forward shape and one window shape; by default the prefix window narrows
    every block (the negative control)."""
    static = forward_shapes(toy, LONG[:1], mode, True)
    default = forward_shapes(toy, LONG[:1], mode, False)
    assert len(static) == len(default) == 7 * 4  # seven blocks of four one-token steps
    assert len(set(static)) == (1 if mode == "none" else 2)
    if mode == "prefix":
        assert len(set(default)) == 1 + 7  # the full forward and one window width per block


def test_the_record_is_allocated_once_and_written_in_place(toy):
    """The record's buffers keep their addresses over a whole decode (every block's full
    forward and every window write into them)."""
    pointers: set[int] = set()
    layer = _static_layer()
    update = layer.update

    def watched(self, key_states, value_states, *args, **kwargs):
        if self.rows is None:
            pointers.add(self.keys.data_ptr())
        return update(self, key_states, value_states, *args, **kwargs)

    layer.update = watched
    try:
        DiffusionDecoder(toy, "quota", cache="dual", block_length=4, static_shapes=True).generate(LONG[:1])
    finally:
        layer.update = update
    assert len(pointers) == len(toy.model.model.layers)  # one buffer per layer, never moved


def compiled_graphs(toy, prompts, mode: str, static: bool) -> int:
    """Graphs ``torch.compile`` builds for the model's forward over one decode (a backend
    that counts and runs each graph as traced: no C compiler needed)."""
    import torch._dynamo

    torch._dynamo.reset()
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    inner = toy.model.forward
    toy.model.forward = functools.wraps(inner)(torch.compile(inner, backend=counting_backend, dynamic=False))
    try:
        with torch._dynamo.config.patch(recompile_limit=64):
            DiffusionDecoder(toy, "quota", cache=mode, block_length=4, static_shapes=static).generate(prompts)
    finally:
        del toy.model.forward
        torch._dynamo.reset()
    return len(graphs)


def test_torch_compile_captures_each_static_shape_once(toy):
    """Over a seven-block decode of one prompt, one graph for the full forward and one for
    the window (prefix: the window that narrows every block by default)."""
    assert compiled_graphs(toy, LONG[:1], "prefix", True) == 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_torch_compile_captures_each_static_shape_once_and_the_default_path_does_not(toy, mode):
    """Negative control: the default prefix path recompiles once per block; the dual one
    has static shapes at batch 1 already (one window shape), but not its record."""
    assert compiled_graphs(toy, LONG[:1], mode, True) == 2
    assert compiled_graphs(toy, LONG[:1], mode, False) == (1 + 7 if mode == "prefix" else 2)


def test_bad_static_shapes_value_is_refused(toy):
    from dloom.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="static_shapes is 'yes'; allowed: True or False"):
        DiffusionDecoder(toy, static_shapes="yes")  # type: ignore[arg-type]


def test_cli_static_shapes_decodes_the_same_text():
    runner = CliRunner()
    args = ["generate", "--cache", "dual", "--block-length", "4", "--json", "story leo shy hen"]
    default = runner.invoke(app, args)
    static = runner.invoke(app, [*args[:-1], "--static-shapes", args[-1]])
    assert default.exit_code == static.exit_code == 0, static.output
    import json

    first, second = json.loads(default.stdout.splitlines()[0]), json.loads(static.stdout.splitlines()[0])
    assert first["text"] == second["text"] and first["nfe"] == second["nfe"]
    assert second["config"]["static_shapes"] is True and first["config"]["static_shapes"] is False
