"""One model-call boundary: :meth:`dloom.ModelAdapter.raw_logits` (and, for an
encoder-prefix/canvas model such as DiffusionGemma, :meth:`~dloom.ModelAdapter.canvas_logits`
beside it) is the only place dloom calls a model, for every decoder, cache, verification
layout and the AR target.

Two checks: no module of the library or of the bundled plugins calls a model outside the
adapter (a ``.model(...)`` call, or any call with ``input_ids=`` that builds no value: every
``transformers`` forward takes them so), and at run
time every forward a model's module sees went through the adapter (a forward pre-hook counts
the module's calls, a wrapper the adapter's)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from dloom import DiffusionDecoder, ModelAdapter, load_model
from dloom.check.tiny import tiny_ar, tiny_dllm
from dloom.errors import ModelError
from dloom_plugins.failfast import FailFastDecoder

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = [ROOT / "core" / "dloom", ROOT / "plugins" / "dloom_plugins"]
BOUNDARY = ROOT / "core" / "dloom" / "model" / "adapter.py"
MODEL_CLASSES = {ROOT / "core" / "dloom" / "model" / "bailing.py"}
"""Model classes dloom ships (a checkpoint family with no ``transformers`` class): their own
forward runs their submodules, which is the model, not dloom calling it."""


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _model_calls(path: Path) -> list[int]:
    """Lines of ``path`` that call a model: ``<anything>.model(...)``, or a call with
    ``input_ids=`` that does not build a value (a class, ``dataclasses.replace``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _callee(node)
        builds = name[:1].isupper() or name == "replace"
        if name == "model" or (not builds and any(k.arg == "input_ids" for k in node.keywords)):
            lines.append(node.lineno)
    return lines


def test_only_the_adapter_calls_a_model_forward():
    found = {
        f"{path.relative_to(ROOT)}:{line}"
        for root in LIBRARY for path in sorted(root.rglob("*.py")) if path != BOUNDARY and path not in MODEL_CLASSES
        for line in _model_calls(path)
    }
    for path in MODEL_CLASSES:  # each is a model class, not a caller of one
        assert "(PreTrainedModel)" in path.read_text(), path
    assert not found, f"model forwards outside ModelAdapter.raw_logits and canvas_logits: {sorted(found)}"
    assert len(_model_calls(BOUNDARY)) == 2  # raw_logits and canvas_logits: the check looks at the right thing


class ForwardCount:
    """Forwards each model's module ran, and calls of :meth:`ModelAdapter.raw_logits`."""

    def __init__(self, monkeypatch, adapters: tuple[ModelAdapter, ...]) -> None:
        self.module = 0
        self.adapter = 0
        self.hooks = [adapter.model.register_forward_pre_hook(self._module_forward) for adapter in adapters]
        raw_logits = ModelAdapter.raw_logits

        def counted(adapter, *args, **kwargs):
            self.adapter += 1
            return raw_logits(adapter, *args, **kwargs)

        monkeypatch.setattr(ModelAdapter, "raw_logits", counted)

    def _module_forward(self, module, args) -> None:
        self.module += 1


@pytest.fixture
def forward_count(monkeypatch):
    """``forward_count(*adapters)``: a :class:`ForwardCount` whose hooks are removed after the test."""
    counts: list[ForwardCount] = []

    def start(*adapters: ModelAdapter) -> ForwardCount:
        counts.append(ForwardCount(monkeypatch, adapters))
        return counts[-1]

    yield start
    for count in counts:
        for hook in count.hooks:
            hook.remove()


@pytest.fixture(scope="module")
def toy() -> ModelAdapter:
    return load_model("toy-dllm")


@pytest.mark.parametrize("strategy, settings", [
    ("threshold", {}), ("threshold", {"cache": "prefix"}), ("threshold", {"cache": "dual"}),
    ("threshold", {"cache": "dual", "static_shapes": True}),
    ("spiffy+threshold", {"budget": 10}), ("spiffy+threshold", {"budget": 10, "cache": "dual"}),
    ("spiffy+threshold", {"budget": 10, "layout": "packed"}),
])
def test_every_diffusion_forward_goes_through_the_adapter(forward_count, toy, strategy, settings):
    count = forward_count(toy)
    result = DiffusionDecoder(toy, strategy, **settings).generate(["add 1 2", "copy abc"])
    assert result.forwards > 0 and count.module > 0
    assert count.module == count.adapter


@pytest.mark.parametrize("drafter_cache", ["none", "prefix"])
def test_every_failfast_forward_of_target_and_drafter_goes_through_the_adapter(forward_count, drafter_cache):
    pair = dict(vocab=16, hidden=32, layers=2, init=0.8, context=128)
    target, drafter = tiny_ar(0, **pair), tiny_dllm(0, **pair)
    count = forward_count(target, drafter)
    result = FailFastDecoder(target, drafter, max_new_tokens=12, drafter_cache=drafter_cache).generate([[5, 6, 7, 8]])
    assert result.forwards > 0 and count.module > result.forwards  # the drafter's forwards too
    assert count.module == count.adapter


def test_the_count_sees_a_forward_that_bypasses_the_adapter(forward_count, toy):
    """The negative control: a direct call of the module is counted by the module alone."""
    count = forward_count(toy)
    ids = torch.tensor([[5, 6, 7]])
    toy.raw_logits(ids)
    with torch.no_grad():
        toy.model(input_ids=ids)
    assert (count.module, count.adapter) == (2, 1)


def test_raw_logits_refuses_a_cache_for_a_model_that_takes_none():
    class NoCache(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, attention_mask=None, position_ids=None):
            return (torch.zeros(*input_ids.shape, 8),)

    adapter = ModelAdapter(NoCache(), mask_token_id=7, eos_token_ids=(1,), pad_token_id=0, name="plain")
    assert adapter.cache_argument is None and not adapter.takes_logits_to_keep
    assert adapter.raw_logits(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 8)
    with pytest.raises(ModelError, match="model 'plain' does not take a KV cache; use cache='none'"):
        adapter.raw_logits(torch.zeros(1, 3, dtype=torch.long), cache=DynamicCache())


def test_raw_logits_keeps_only_the_asked_columns_where_the_model_can(toy):
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert toy.takes_logits_to_keep and toy.cache_argument is not None
    every = toy.raw_logits(ids)
    kept = toy.raw_logits(ids, logits_to_keep=torch.tensor([1, 3]))
    torch.testing.assert_close(kept, every[:, [1, 3]])
    assert toy.shift == int(toy.shift_logits)
