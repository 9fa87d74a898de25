"""Static shapes (``DiffusionDecoder(static_shapes=True)``, ``dloom.model.runner.static_view``).

For a fixed set of rows every forward of a kind keeps its shapes across steps and blocks
(full forwards ``(R, L)``, cached windows ``(R, W)``, a record preallocated once and written
in place; Spiffy's verification calls padded to one row count, packed layouts to one span
count), so that a compiled model reuses its graphs. The tokens and NFE (and for Spiffy the
accepted drafts and model calls) are those of the default path on the toy zoo; cached logits
agree up to float rounding.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import pytest
import torch
from typer.testing import CliRunner

import dloom.decode.speculation
from dloom import DiffusionDecoder, load_model
from dloom.cli.commands import app
from dloom.model.runner import BlockForward, _static_layer
from dloom.zoo.tasks import held_out

STRATEGIES = ["quota", "threshold", "frechet"]
SPIFFY = ["spiffy+threshold", "spiffy+quota", "spiffy+frechet"]
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


def spiffy_decoder(toy, strategy: str, mode: str, static: bool, layout: str = "rows") -> DiffusionDecoder:
    with warnings.catch_warnings():  # no built-in graph for blocks of 4: the default graph
        warnings.simplefilter("ignore")
        return DiffusionDecoder(
            toy, strategy, cache=mode, block_length=4, static_shapes=static,
            **{"spiffy.layout": layout, "spiffy.budget": 10},
        )


def verification_figures(toy, decoder: DiffusionDecoder, prompts, monkeypatch):
    """What a decode must keep under static shapes (tokens, NFE, steps, verifications,
    accepted drafts, model calls, layout exactness), and the ``(B, input shape, cache
    layer class)`` of every verification model call (``B`` the batch's rows at the time)."""
    calls: list[tuple[int, tuple[int, ...]]] = []
    batch: list[int] = []
    evaluate = BlockForward.evaluate

    def watched(self, tokens, layout, first_window):
        batch.append(tokens.shape[0])
        try:
            return evaluate(self, tokens, layout, first_window)
        finally:
            batch.pop()

    def record(_, args, kwargs):
        if batch:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            layer = None if cache is None else type(cache.layers[0]).__name__
            calls.append((batch[-1], tuple(kwargs["input_ids"].shape), layer))

    with monkeypatch.context() as patch:
        patch.setattr(BlockForward, "evaluate", watched)
        hook = toy.model.register_forward_pre_hook(record, with_kwargs=True)
        try:
            result = decoder.generate(prompts)
        finally:
            hook.remove()
    figures = (
        result.token_lists, result.nfe.tolist(), result.forwards, result.verification_forwards,
        result.verifications, result.accepted_drafts, result.model_calls, result.layout_exact,
    )
    return figures, calls


def shapes_per_batch(calls) -> dict[int, set]:
    by_batch: dict[int, set] = {}
    for rows, shape, _ in calls:
        by_batch.setdefault(rows, set()).add(shape)
    return by_batch


SPIFFY_CASES = [(strategy, "rows") for strategy in SPIFFY] + [("spiffy+frechet", "packed")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("strategy", "layout"), SPIFFY_CASES)
def test_static_verification_decodes_the_default_tokens_nfe_drafts_and_calls(toy, prompts, strategy, layout, mode, monkeypatch):
    """Spiffy on eight zoo prompts in one batch (rows leaving, rows in different blocks):
    with static shapes the same tokens, NFE, steps, verifications, accepted drafts, model
    calls and layout exactness as the default path, and every verification model call of a
    batch of ``B`` rows has one shape (packed: at most two, the packed layout's and the one
    of a verification that evaluates roots alone, which is no packed layout), where the
    default path's vary."""
    default, default_calls = verification_figures(toy, spiffy_decoder(toy, strategy, mode, False, layout), prompts, monkeypatch)
    static, static_calls = verification_figures(toy, spiffy_decoder(toy, strategy, mode, True, layout), prompts, monkeypatch)
    assert static == default, (strategy, layout, mode)
    assert default[5] > 0 and static_calls  # drafts were accepted; verifications ran
    most = 1 if layout == "rows" else 2
    assert all(len(shapes) <= most for shapes in shapes_per_batch(static_calls).values())
    if layout == "rows":  # the default path's layouts change their row count
        assert any(len(shapes) > 1 for shapes in shapes_per_batch(default_calls).values())
    # cached verification on the static record: rows write their windows into a copy of it,
    # packed spans read it (they have no record column to write at)
    expected = {"none": {None}, "prefix": {"StaticRecordLayer"}, "dual": {"StaticRecordLayer"}}[mode]
    if layout == "packed" and mode != "none":
        expected = {"RecordLayer", "StaticRecordLayer"}  # packed, and roots alone (rows)
    assert {layer for _, _, layer in static_calls} <= expected
    assert {layer for _, _, layer in default_calls} <= {None, "RecordLayer"}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("strategy", "layout"), SPIFFY_CASES)
def test_static_verification_decodes_the_default_figures_one_prompt_at_a_time(toy, prompts, strategy, layout, mode, monkeypatch):
    """As above, each prompt alone (a batch of one: one verification shape per decode)."""
    for prompt in prompts:
        default, _ = verification_figures(toy, spiffy_decoder(toy, strategy, mode, False, layout), [prompt], monkeypatch)
        static, calls = verification_figures(toy, spiffy_decoder(toy, strategy, mode, True, layout), [prompt], monkeypatch)
        assert static == default, (strategy, layout, mode, prompt)
        assert len({shape for _, shape, _ in calls}) <= (1 if layout == "rows" else 2)


def test_static_parts_have_one_row_count_and_put_every_rows_outputs_in_its_place():
    """``static_rows``: every call holds exactly that many rows (the last one, or a layout
    smaller than one call, padded), as many calls as without it, and row ``r`` of the result
    is layout row ``r``'s (a forward that writes each row's own ids and source)."""
    from dloom.decode.speculation import (
        evaluate_in_parts,
        rows_layout,
        static_call_rows,
    )
    from dloom.errors import HookContractError

    spans = torch.arange(3 * 4 * 2).reshape(3, 4, 2)
    evaluated = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    layout = dataclasses.replace(rows_layout(spans, evaluated), row_bound=3)  # 8 rows, at most 3 x 3
    calls = []

    def forward(tokens, part, first_window):
        calls.append(part.input_ids.shape[0])
        real = part.segment[:, :1] >= 0  # padding rows write -1: a result holding one is caught
        return torch.where(real[..., None], torch.stack([part.input_ids, part.source[:, None].expand_as(part.input_ids)], -1), -1)

    whole = forward(None, layout, 0)
    for max_rows, rows, expected in [(3, 3, [3, 3, 3]), (8, 8, [8]), (20, 9, [9])]:
        assert static_call_rows(layout, max_rows) == rows
        calls.clear()
        assert torch.equal(evaluate_in_parts(forward, None, layout, 0, max_rows, rows), whole)
        assert calls == expected
    with pytest.raises(HookContractError, match="has 8 rows for 3 batch rows, more than its row_bound of 2"):
        static_call_rows(dataclasses.replace(layout, row_bound=2), 20)


def test_a_static_packed_layout_has_its_slots_and_the_default_packed_flag():
    """``slots``: every row ``slots`` spans wide, the extra spans segment ``-1``, the nodes
    where they are without it; ``packed`` says whether a row holds two real spans (as
    without slots); fewer slots than a row's nodes are refused."""
    from dloom.decode.speculation import packed_layout
    from dloom.errors import HookContractError

    spans = torch.arange(2 * 4 * 3).reshape(2, 4, 3)
    evaluated = torch.tensor([[1, 0, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    default, static = packed_layout(spans, evaluated), packed_layout(spans, evaluated, 4)
    assert static.input_ids.shape == (2, 12) and default.input_ids.shape == (2, 6)
    assert torch.equal(static.input_ids[:, :6], default.input_ids)
    assert torch.equal(static.segment[:, :6], default.segment) and (static.segment[:, 6:] == -1).all()
    assert torch.equal(static.node_offsets, default.node_offsets) and static.packed == default.packed is True
    roots = torch.tensor([[1, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert packed_layout(spans, roots, 4).packed is False and packed_layout(spans, roots).packed is False
    with pytest.raises(HookContractError, match="a row evaluates 2 nodes, more than the layout's 1 slots"):
        packed_layout(spans, evaluated, 1)


def pad_in_front(layout, rows):
    """Broken :func:`dloom.decode.speculation.pad_layout`: the padding rows first, so that a call's
    first outputs (read as the real rows') are the padding's."""
    extra = rows - layout.input_ids.shape[0]
    if extra <= 0:
        return layout

    def padded(field):
        return torch.cat([field[:1].expand(extra, *field.shape[1:]), field])

    return dataclasses.replace(
        layout, input_ids=padded(layout.input_ids), source=padded(layout.source),
        segment=padded(layout.segment), span_position=padded(layout.span_position),
    )


def unmasked_padding(packed_layout):
    """Broken :func:`dloom.decode.speculation.packed_layout`: with static slots, the padding spans
    carry node 1's segment, so that node 1's span attends to them (and they to it)."""

    def broken(spans, evaluated, slots=None):
        layout = packed_layout(spans, evaluated, slots)
        if slots is None:
            return layout
        return dataclasses.replace(layout, segment=torch.where(layout.segment < 0, 1, layout.segment))

    return broken


@pytest.mark.parametrize(
    ("strategy", "layout", "mode", "target", "broken"),
    [
        ("spiffy+quota", "rows", "dual", "pad_layout", lambda original: pad_in_front),
        ("spiffy+frechet", "packed", "dual", "packed_layout", unmasked_padding),
    ],
    ids=["padding-rows-read", "padding-spans-unmasked"],
)
def test_broken_static_padding_is_caught(toy, prompts, strategy, layout, mode, target, broken, monkeypatch):
    """Negative controls of the identity test above: padding rows whose outputs are read as
    real rows', and padding spans that a real span attends to, both change the decode."""
    default, _ = verification_figures(toy, spiffy_decoder(toy, strategy, mode, False, layout), prompts, monkeypatch)
    monkeypatch.setattr(dloom.decode.speculation, target, broken(getattr(dloom.decode.speculation, target)))
    static, _ = verification_figures(toy, spiffy_decoder(toy, strategy, mode, True, layout), prompts, monkeypatch)
    assert static != default


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


def compiled_graphs(toy, prompts, mode: str, static: bool, strategy: str = "quota") -> int:
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
            with warnings.catch_warnings():  # Spiffy: no built-in graph for blocks of 4
                warnings.simplefilter("ignore")
                fixed = {"spiffy.budget": 10} if strategy.startswith("spiffy") else {}  # not timed: auto measures
                decoder = DiffusionDecoder(toy, strategy, cache=mode, block_length=4, static_shapes=static, **fixed)
            result = decoder.generate(prompts)
    finally:
        del toy.model.forward
        torch._dynamo.reset()
    assert result.verification_forwards > 1 or not strategy.startswith("spiffy")
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


def test_torch_compile_captures_a_spiffy_decode_in_two_graphs_and_the_default_path_in_more(toy):
    """Spiffy over quota, one prompt over seven blocks, no cache: 12 verifications of 3, 5
    or 7 layout rows (when measured), with static shapes all padded to 8 (the default
    graph's 7 drafts and the root), so one graph for the plain step at each block start and
    one for every verification call; the default path compiles one per verification row
    count it meets (4 graphs when measured: the negative control)."""
    assert compiled_graphs(toy, LONG[:1], "none", True, "spiffy+quota") == 2
    assert compiled_graphs(toy, LONG[:1], "none", False, "spiffy+quota") > 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_torch_compile_captures_a_cached_spiffy_decode_in_two_graphs(toy, mode):
    """With a cache: the full forward and the verification window on the static record
    (two graphs); the default path compiles far more (38 with the dual cache and 134 with
    the prefix one when measured: each verification's row count and each block's record
    and window)."""
    assert compiled_graphs(toy, LONG[:1], mode, True, "spiffy+quota") == 2
    assert compiled_graphs(toy, LONG[:1], mode, False, "spiffy+quota") > 8


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
