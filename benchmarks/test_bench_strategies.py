"""pytest-benchmark suites: per-hook micro-benchmarks and end-to-end decoding per strategy.

Run (not part of the default test run; ``docs/benchmarks/index.md`` has the workflow)::

    python -m pytest benchmarks/test_bench_strategies.py --benchmark-json benchmarks/results/pytest-benchmark.json
    python -m pytest benchmarks/test_bench_strategies.py --benchmark-autosave   # keep a run under .benchmarks/
    python -m pytest benchmarks/test_bench_strategies.py --benchmark-compare    # against the last saved run

    python -m pytest benchmarks/test_bench_strategies.py --strategies quota,threshold,my-rule,spiffy+my-rule
    python -m pytest benchmarks/test_bench_strategies.py --benchmark-disable --bench-prompts 2   # CI: runs once

Micro-benchmarks time one call of each decoding hook: the ``dloom_select_commit`` of every
commit rule among the strategies (``--strategies``, ``benchmarks/conftest.py``; default the
built-ins) on a (64, 32) block of random confidences, and Spiffy's ``dloom_draft``,
``dloom_prune``, ``dloom_build_mask`` and ``dloom_verify`` on the arguments of a real decode
(captured from its first verification). End-to-end benchmarks decode ``--bench-prompts``
(32) held-out prompts per strategy on the toy zoo's ``toy-dllm`` when its weights are
present, else on a tiny random model; each records NFE, tokens per forward and hook shares
in ``extra_info`` so the JSON carries them next to the timings.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import warnings

import pytest
import torch

from dloom import BlockSchedule, DiffusionDecoder, ModelAdapter, hookimpl, load_model
from dloom.decode.kernel import commit_signals
from dloom.errors import DloomError
from dloom.hooks import specs as hookspecs
from dloom.hooks.composition import compose
from dloom.hooks.registry import get_registry, hooks_implemented_by
from dloom.zoo import model_path
from dloom.zoo.tasks import held_out
from dloom_plugins.spiffy import Spiffy

SPECULATION_HOOKS = [hook.removeprefix("dloom_") for hook in hookspecs.SPECULATION_HOOKS]


def strategies(config: pytest.Config) -> list[str]:
    """The strategies of ``--strategies``, each checked to be registered (or composable)."""
    names = [name.strip() for name in config.getoption("--strategies").split(",") if name.strip()]
    for name in names:
        try:
            compose(name)
        except DloomError as error:
            raise pytest.UsageError(f"--strategies: {error}") from None
    return names


def is_commit_rule(name: str) -> bool:
    """Whether ``name`` is one registered strategy that answers ``dloom_select_commit``."""
    if "+" in name or "@" in name:
        return False
    return "dloom_select_commit" in hooks_implemented_by(get_registry().get(name).registration.plugin_class)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = strategies(metafunc.config)
    if "rule_name" in metafunc.fixturenames:
        metafunc.parametrize("rule_name", [name for name in names if is_commit_rule(name)])
    if "strategy_name" in metafunc.fixturenames:
        metafunc.parametrize("strategy_name", names)


def commit_rule(name: str):
    return get_registry().get(name).build(
        **{p.name: p.default for p in get_registry().get(name).parameters}
    )


def test_select_commit(benchmark, rule_name):
    """One ``dloom_select_commit`` call on a (64, 32) block of random confidences (and
    the signals the rule declared, from random logits over 16 tokens), with the
    arguments it takes."""
    generator = torch.Generator().manual_seed(0)
    confidence = torch.rand(64, 32, dtype=torch.float64, generator=generator)
    selectable = torch.rand(64, 32, generator=generator) < 0.7
    schedule = BlockSchedule(0, 32, selectable.sum(-1))
    rule = commit_rule(rule_name)
    arguments = {"confidence": confidence, "selectable": selectable, "schedule": schedule}
    declared = getattr(rule.dloom_select_commit, hookspecs.SIGNALS_ATTRIBUTE, ())
    if declared:
        logits = torch.randn(64, 32, 17, dtype=torch.float64, generator=generator)
        candidates = logits[..., :16].argmax(-1)
        block = torch.where(selectable, 16, candidates)  # the selectable positions masked (id 16)
        arguments["signals"] = commit_signals(logits, candidates, block, declared, 16)
    taken = inspect.signature(rule.dloom_select_commit).parameters
    commit = benchmark(rule.dloom_select_commit, **{k: v for k, v in arguments.items() if k in taken})
    assert (commit & ~selectable).sum() == 0


@pytest.fixture(scope="module")
def model() -> ModelAdapter:
    if (model_path("toy-dllm") / "config.json").exists():
        return load_model("toy-dllm")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=57, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, is_causal=False,
                         initializer_range=0.5, max_position_embeddings=128)
    return ModelAdapter(LlamaForCausalLM(config).eval(), mask_token_id=1, eos_token_ids=(2,),
                        pad_token_id=0, default_gen_length=32, name="tiny-random")


SPECULATION_PROMPTS = 8
"""The fewest prompts the speculation hooks' arguments are captured from (on fewer, toy-dllm
may finish every block before Spiffy drafts)."""


def prompt_list(model: ModelAdapter, count: int) -> list:
    """``count`` held-out task prompts, or fixed ids for a model without a tokenizer."""
    return [e.prompt for e in held_out(count)] if model.tokenizer is not None else [[5, 6, 7, 8]] * count


@pytest.fixture(scope="module")
def prompts(request, model) -> list:
    """The ``--bench-prompts`` prompts every decode takes."""
    return prompt_list(model, request.config.getoption("--bench-prompts"))


def decoder_for(model: ModelAdapter, strategy: str) -> DiffusionDecoder:
    """A decoder; on the tiny random model Spiffy warns that it has no calibrated graph, and
    runs at a fixed budget of 10 (``budget=auto`` takes no drafts from an uncalibrated graph)."""
    params = {"spiffy.budget": 10} if "spiffy" in strategy.split("+") else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DiffusionDecoder(model, strategy, params=params)


class FirstCalls:
    """A ``wrapper=True`` plugin keeping the arguments of the first call of each
    speculation hook (the state's tokens copied, since the decoder updates them in place,
    and the kernel step copied, since it keeps one row per row of the running batch and
    follows the batch as rows leave)."""

    def __init__(self) -> None:
        self.calls: dict[str, dict] = {}

    def _keep(self, hook: str, **arguments) -> None:
        if hook not in self.calls:
            if "state" in arguments:
                state = arguments["state"]
                arguments["state"] = dataclasses.replace(state, tokens=state.tokens.clone())
            if "kernel" in arguments:
                kernel = copy.copy(arguments["kernel"])
                kernel.generator = copy.copy(kernel.generator)
                arguments["kernel"] = kernel
            self.calls[hook] = arguments

    @hookimpl(wrapper=True)
    def dloom_draft(self, state):
        self._keep("draft", state=state)
        return (yield)

    @hookimpl(wrapper=True)
    def dloom_prune(self, graph, budget):
        self._keep("prune", graph=graph, budget=budget)
        return (yield)

    @hookimpl(wrapper=True)
    def dloom_build_mask(self, state, graph):
        self._keep("build_mask", state=state, graph=graph)
        return (yield)

    @hookimpl(wrapper=True)
    def dloom_verify(self, state, graph, logits, kernel):
        self._keep("verify", state=state, graph=graph, logits=logits, kernel=kernel)
        return (yield)


@pytest.fixture(scope="module")
def speculation(model, prompts) -> tuple[Spiffy, dict[str, dict]]:
    """Spiffy over threshold 0.9, configured by a decoder, and the arguments its four
    speculation hooks received in a real decode."""
    decoder = decoder_for(model, "spiffy+threshold")
    first = FirstCalls()
    decoder.pm.register(first)
    decoder.generate(prompts if len(prompts) >= SPECULATION_PROMPTS else prompt_list(model, SPECULATION_PROMPTS))
    spiffy = next(p for p in decoder.pm.get_plugins() if isinstance(p, Spiffy))
    assert set(first.calls) == set(SPECULATION_HOOKS), "the decode never speculated"
    return spiffy, first.calls


@pytest.mark.parametrize("hook", SPECULATION_HOOKS)
def test_speculation_hook(benchmark, speculation, hook):
    """One call of a Spiffy hook on the arguments it had in a real decode."""
    spiffy, calls = speculation
    result = benchmark(getattr(spiffy, f"dloom_{hook}"), **calls[hook])
    assert result is not None
    benchmark.extra_info.update(rows=int(calls["draft"]["state"].tokens.shape[0]),
                                drafts=spiffy.graph.budget)


def test_decode(benchmark, model, prompts, strategy_name):
    """Decode the prompts (held-out ones, or fixed ids without a tokenizer) with each strategy."""
    decoder = decoder_for(model, strategy_name)
    result = benchmark.pedantic(decoder.generate, args=(prompts,), rounds=3, warmup_rounds=1)
    benchmark.extra_info.update(
        model=model.name, nfe_mean=float(result.nfe.double().mean()), tpf=result.tpf,
        hook_share=result.hook_share, speculation=result.speculation,
    )
