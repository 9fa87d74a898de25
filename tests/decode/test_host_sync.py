"""No host synchronisation in the decoding loop beyond one per step.

On a GPU every device-to-host read (``.item()``, ``.tolist()``, ``bool(tensor)``, ``.cpu()``,
``torch.nonzero``, boolean-mask indexing, ...) waits for the queued kernels. CUDA's sync
debug mode does not exist on CPU, so these calls are counted instead: each is replaced by a
counter for the duration of one :meth:`DiffusionDecoder.generate`. A call made while a
``torch.nn.Module`` is running is the model's own (transformers' mask helpers, say), anything
else is the decoder's (engine, cache, hooks, plugins).

The contract (docs/concepts.md): the decoder syncs exactly once per step (rows advance
through blocks and leave the batch on what that one read tells), plus a constant per call
(padding check, the first step's plan, results), and a speculative strategy once more per
verification forward (the layout's row count). A per-token, per-row or per-block sync breaks
the count, because every case runs many steps per block and several rows. The model itself
syncs never: padded batches get a prepared 4-D mask (transformers' 2-D mask path reads the
device once per forward).
"""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from conftest import MASK_ID, PAD_ID, sharpen, tiny_model
from dloom import DiffusionDecoder, ModelAdapter, hookimpl
from dloom_plugins.spiffy import Spiffy

PER_CALL = 4  # padding check, the first step's plan, lengths and tokens to lists

_MODULE_CALLS = {torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__}
_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero")
_FUNCTIONS = ("nonzero", "argwhere", "masked_select", "unique")


def _bool_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class SyncCounter:
    """Host synchronisations by kind, split into the decoder's and the model's."""

    def __init__(self) -> None:
        self.decoder: Counter[str] = Counter()
        self.model: Counter[str] = Counter()

    def record(self, kind: str) -> None:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code in _MODULE_CALLS:
                self.model[kind] += 1
                return
            frame = frame.f_back
        self.decoder[kind] += 1

    @contextmanager
    def counting(self, monkeypatch):
        with monkeypatch.context() as patch:
            for name in _METHODS:
                patch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), name))
            for name in _FUNCTIONS:
                patch.setattr(torch, name, self._wrap(getattr(torch, name), f"torch.{name}"))
            for name in ("__getitem__", "__setitem__"):
                patch.setattr(torch.Tensor, name, self._wrap_index(getattr(torch.Tensor, name), name))
            yield self

    def _wrap(self, original, kind):
        def counted(*args, **kwargs):
            self.record(kind)
            return original(*args, **kwargs)

        return counted

    def _wrap_index(self, original, kind):
        def counted(tensor, index, *rest):
            if _bool_index(index):
                self.record(f"{kind}[bool]")
            return original(tensor, index, *rest)

        return counted


def adapter(**overrides) -> ModelAdapter:
    """A float64 tiny model without EOS, so that every row runs every step."""
    values = dict(
        model=sharpen(tiny_model(seed=1, initializer_range=0.5)), mask_token_id=MASK_ID,
        eos_token_ids=(), pad_token_id=PAD_ID, max_context=96, name="tiny",
    )
    values.update(overrides)
    return ModelAdapter(**values)


PADDED = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [15, 16, 17, 18], [19, 20]]


def count(monkeypatch, decoder: DiffusionDecoder, prompts) -> tuple[SyncCounter, object]:
    decoder.generate(prompts)  # warm-up outside the count
    with SyncCounter().counting(monkeypatch) as counter:
        result = decoder.generate(prompts)
    return counter, result


def assert_bounded(counter: SyncCounter, result, blocks: int) -> None:
    total = sum(counter.decoder.values())
    bound = result.forwards + result.verification_forwards + PER_CALL
    assert total <= bound, (
        f"decoder synced {total} times in {result.forwards} steps over {blocks} blocks "
        f"(bound {bound}): {dict(counter.decoder)}"
    )
    assert total == bound, f"the count moved: {total} syncs, expected {bound}: {dict(counter.decoder)}"


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("strategy", ["quota", "threshold", "frechet"])
@pytest.mark.parametrize("prompts", [[[5, 6, 7]], PADDED], ids=["one-row", "five-rows-padded"])
def test_at_most_one_sync_per_step(monkeypatch, strategy, cache, prompts):
    decoder = DiffusionDecoder(adapter(), strategy, gen_length=32, block_length=8, cache=cache)
    counter, result = count(monkeypatch, decoder, prompts)
    assert_bounded(counter, result, blocks=4)
    assert result.forwards >= 8  # several steps per block: a per-token sync would show
    assert not counter.model, f"the model synced: {dict(counter.model)}"


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize(
    "conventions", [{"shift_logits": True}, {"attention": "block-causal"}], ids=["shifted", "block-causal"]
)
def test_model_conventions_add_no_sync(monkeypatch, conventions, cache):
    decoder = DiffusionDecoder(adapter(**conventions), "threshold", gen_length=32, block_length=8, cache=cache)
    counter, result = count(monkeypatch, decoder, PADDED)
    assert_bounded(counter, result, blocks=4)


def test_sync_count_does_not_grow_with_rows_or_tokens_per_step(monkeypatch):
    """Exact counts: one row vs five rows, one token per step vs a whole block at once."""
    counts = {}
    for name, strategy, params, prompts in [
        ("one row, one token/step", "quota", {}, [[5, 6, 7]]),
        ("five rows, one token/step", "quota", {}, PADDED),
        ("five rows, a block/step", "threshold", {"tau": 1e-9}, PADDED),
    ]:
        decoder = DiffusionDecoder(adapter(), strategy, gen_length=32, block_length=8, params=params)
        counter, result = count(monkeypatch, decoder, prompts)
        counts[name] = (sum(counter.decoder.values()) - result.forwards, result.forwards)
    assert counts["one row, one token/step"][1] == counts["five rows, one token/step"][1] == 32
    assert counts["five rows, a block/step"][1] == 4
    beyond_steps = {c[0] for c in counts.values()}
    assert len(beyond_steps) == 1 and beyond_steps.pop() == PER_CALL, counts


class PerRowSync:
    """A commit rule with a per-row host sync: the counter must flag it."""

    @hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        commit = torch.zeros_like(selectable)
        for row in range(selectable.shape[0]):
            if selectable[row].any():  # bool(tensor): a sync per row per step
                commit[row, int(torch.argmax(confidence[row].masked_fill(~selectable[row], -1)))] = True
        return commit


def test_negative_control_per_row_sync_is_caught(monkeypatch):
    decoder = DiffusionDecoder(adapter(), PerRowSync(), gen_length=32, block_length=8)
    counter, result = count(monkeypatch, decoder, PADDED)
    with pytest.raises(AssertionError, match="decoder synced"):
        assert_bounded(counter, result, blocks=4)
    assert counter.decoder["__bool__"] >= len(PADDED) * result.forwards


def test_negative_control_a_count_below_the_pinned_one_is_caught(monkeypatch):
    """The count is pinned, not bounded: one sync fewer than expected fails too."""
    decoder = DiffusionDecoder(adapter(), "quota", gen_length=32, block_length=8)
    counter, result = count(monkeypatch, decoder, PADDED)
    assert_bounded(counter, result, blocks=4)
    one_more_step = SimpleNamespace(forwards=result.forwards + 1, verification_forwards=0)
    with pytest.raises(AssertionError, match="the count moved"):
        assert_bounded(counter, one_more_step, blocks=4)


def test_model_syncs_are_attributed_to_the_model(monkeypatch):
    class Syncing(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            if torch.isfinite(kwargs["input_ids"].float()).all():  # a sync inside the model
                return self.inner(**kwargs)

    decoder = DiffusionDecoder(adapter(model=Syncing(tiny_model())), gen_length=16, block_length=8)
    counter, result = count(monkeypatch, decoder, [[5, 6]])
    assert counter.model["__bool__"] == result.forwards
    assert_bounded(counter, result, blocks=2)


# Per verification forward of a speculative strategy, beyond the step's own sync: exactly one,
# the layout's size (``torch.nonzero`` over the kept drafts for the rows layout, the longest
# row for the packed one). The verifier's walk over the graph reads nothing.
PER_VERIFICATION = 1


@pytest.mark.parametrize("layout, cache", [("rows", "none"), ("packed", "dual"), ("rows", "prefix"), ("packed", "none")])
@pytest.mark.parametrize("prompts", [[[5, 6, 7]], PADDED], ids=["one-row", "five-rows-padded"])
def test_speculation_syncs_a_constant_per_verification(monkeypatch, layout, cache, prompts):
    with pytest.warns(UserWarning, match="uncalibrated default graph"):
        decoder = DiffusionDecoder(
            adapter(), "spiffy", gen_length=32, block_length=8, cache=cache, layout=layout, budget=10
        )
    counter, result = count(monkeypatch, decoder, prompts)
    assert result.accepted_drafts > 0 and result.verification_forwards > 0
    assert_speculation_pinned(counter, result)
    assert not counter.model


def assert_speculation_pinned(counter: SyncCounter, result) -> None:
    total = sum(counter.decoder.values())
    expected = result.forwards + result.verification_forwards * PER_VERIFICATION + PER_CALL
    assert total == expected, f"{total} syncs, expected {expected}: {dict(counter.decoder)}"


class VerifierReadingTheDevice(Spiffy):
    """Spiffy with one extra host read per verification forward (``bool(on_graph.any())``,
    one of the reads the verifier once made): the exact count must flag it."""

    @hookimpl
    def dloom_verify(self, state, graph, logits, kernel):
        verdict = super().dloom_verify(state, graph, logits, kernel)
        if bool(verdict.accepted.any()):  # a sync per verification forward
            pass
        return verdict


def test_negative_control_one_more_sync_per_verification_is_caught(monkeypatch):
    with pytest.warns(UserWarning, match="uncalibrated default graph"):
        decoder = DiffusionDecoder(adapter(), [VerifierReadingTheDevice(budget=10), "quota"], gen_length=32, block_length=8)
    counter, result = count(monkeypatch, decoder, PADDED)
    assert result.verification_forwards > 0
    with pytest.raises(AssertionError, match="syncs, expected"):
        assert_speculation_pinned(counter, result)
