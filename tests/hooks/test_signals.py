"""Commit rules that read the block's distribution: declared signals, computed by the
kernel, exercised by ``dloom check``; an entropy-bounded rule written as a third party would."""

from __future__ import annotations

import math

import pytest
import torch

import dloom
from conftest import tiny_model
from dloom import Claim, DiffusionDecoder, ModelAdapter, Parameter, StrategyRegistration
from dloom.check import check_strategy, tiny
from dloom.decode import kernel
from dloom.errors import ConfigurationError
from dloom.hooks.registry import Strategy, get_registry


class EntropyBounded:
    """Commit every masked position whose entropy is at most ``bound`` nats, and the surest
    one when none is."""

    def __init__(self, bound: float = 0.5) -> None:
        self.bound = bound

    @dloom.hookimpl
    @dloom.reads_signals("entropy")
    def dloom_select_commit(self, selectable, signals):
        entropy = torch.where(selectable, signals["entropy"], torch.inf)
        surest = torch.zeros_like(selectable).scatter_(-1, entropy.argmin(-1, keepdim=True), True)
        return ((entropy <= self.bound) | surest) & selectable


class Undeclared(EntropyBounded):
    """Reads the entropy without declaring it (a bug: it gets no signals)."""

    @dloom.hookimpl
    def dloom_select_commit(self, selectable, signals):
        return super().dloom_select_commit(selectable, signals)


class Unrestricted(EntropyBounded):
    """Forgets to restrict its commits to ``selectable`` (a bug: decoded positions are surer)."""

    @dloom.hookimpl
    @dloom.reads_signals("entropy")
    def dloom_select_commit(self, selectable, signals):
        return (signals["entropy"] <= self.bound) | super().dloom_select_commit(selectable, signals)


class Silent:
    """Commit everything and keep the signals of every step (declares none)."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    @dloom.hookimpl
    def dloom_select_commit(self, selectable, signals):
        self.seen.append(dict(signals))
        return selectable.clone()


class ReadsAll(Silent):
    """The same, declaring every signal."""

    @dloom.hookimpl
    @dloom.reads_signals("entropy", "margin", "confidence", "probabilities")
    def dloom_select_commit(self, selectable, signals):
        return super().dloom_select_commit(selectable, signals)


def registration(plugin_class=EntropyBounded, name="entropy-bounded") -> StrategyRegistration:
    return StrategyRegistration(
        name, plugin_class,
        parameters=[Parameter("bound", 0.5, float, "entropy bound in nats", low=0.0)],
        summary="positions whose entropy is at most bound", claim=Claim("approximate", against="quota"),
    )


@pytest.fixture
def registered():
    registry = get_registry()
    for plugin_class, name in ((EntropyBounded, "entropy-bounded"), (Undeclared, "undeclared"), (Unrestricted, "unrestricted")):
        registry.strategies[name] = Strategy(name, "tests", registration(plugin_class, name))


@pytest.fixture(autouse=True)
def tiny_greedy_model(monkeypatch):
    monkeypatch.setattr(tiny, "zoo_installed", lambda *names: False)


def adapter() -> ModelAdapter:
    return ModelAdapter(tiny_model(), mask_token_id=39, eos_token_ids=[2], pad_token_id=0)


def test_unknown_signals_are_refused():
    with pytest.raises(ConfigurationError, match="unknown signal 'entropie'; allowed: confidence, margin, entropy, probabilities"):
        dloom.reads_signals("entropie")
    with pytest.raises(ConfigurationError, match="no signal named"):
        dloom.reads_signals()


def test_the_kernel_computes_the_declared_signals_and_only_those(monkeypatch):
    rule = ReadsAll()
    steps = []
    DiffusionDecoder(adapter(), rule, gen_length=4, block_length=4, steps=4).generate(
        [[5, 6, 7]], observer=steps.append
    )
    logits = steps[0].logits.to(torch.float64).clone()
    logits[..., 39] = -torch.inf
    probs = torch.softmax(logits, dim=-1)
    signals = rule.seen[0]
    assert set(signals) == {"entropy", "margin", "confidence", "probabilities"}
    torch.testing.assert_close(signals["probabilities"], probs)
    torch.testing.assert_close(signals["entropy"], -(probs * probs.log().nan_to_num(neginf=0)).sum(-1))
    top = probs.topk(2, dim=-1).values
    torch.testing.assert_close(signals["margin"], top[..., 0] - top[..., 1])
    torch.testing.assert_close(signals["confidence"], top[..., 0])  # greedy: the argmax's probability
    assert signals["entropy"].dtype == torch.float64 and (signals["entropy"] >= 0).all()

    silent = Silent()
    monkeypatch.setattr(kernel, "commit_signals", lambda *a: pytest.fail("computed undeclared signals"))
    DiffusionDecoder(adapter(), silent, gen_length=4, block_length=4).generate([[5, 6, 7]])
    assert silent.seen and all(signals == {} for signals in silent.seen)


def test_an_entropy_bounded_rule_decodes_whatever_the_remasking(registered):
    prompts = [[5, 6, 7], [8, 9], [10]]
    blocks = lambda tokens: math.ceil(len(tokens) / 4)  # noqa: E731 - blocks an output spans
    everything = DiffusionDecoder(adapter(), "entropy-bounded", bound=100.0, gen_length=8, block_length=4)
    result = everything.generate(prompts)
    assert result.nfe.tolist() == [blocks(t) for t in result.token_lists]  # a block per step
    one = DiffusionDecoder(adapter(), "entropy-bounded", bound=0.0, gen_length=8, block_length=4).generate(prompts)
    for n, tokens in zip(one.nfe.tolist(), one.token_lists):  # one position per step
        assert len(tokens) <= n <= 4 * blocks(tokens)
    assert one.nfe.sum() > result.nfe.sum()
    for remasking in ("random", "margin", "entropy"):  # the rule reads its signal, not --remasking
        other = DiffusionDecoder(
            adapter(), "entropy-bounded", bound=0.0, gen_length=8, block_length=4, remasking=remasking, seed=0
        ).generate(prompts)
        assert other.token_lists == one.token_lists and other.nfe.tolist() == one.nfe.tolist()


@pytest.mark.filterwarnings("ignore:no built-in draft graph fits")
def test_dloom_check_exercises_the_rule_and_refutes_its_broken_variants(registered):
    report = check_strategy("entropy-bounded", temperature=0)
    assert (report.verdict, report.exit_code) == ("approximate", 0), report.render()
    lossless = check_strategy("spiffy+entropy-bounded", params={"entropy-bounded.bound": 0.3}, samples=6000, epsilon=0.1)
    assert lossless.verdict == "lossless", lossless.render()
    undeclared = check_strategy("undeclared", temperature=0)
    assert (undeclared.verdict, undeclared.exit_code) == ("contract broken", 1)
    assert "raised KeyError in dloom_select_commit: 'entropy'" in undeclared.reason
    unrestricted = check_strategy("unrestricted", temperature=0)
    assert (unrestricted.verdict, unrestricted.exit_code) == ("contract broken", 1)
    assert "not selectable (already decoded" in unrestricted.reason
