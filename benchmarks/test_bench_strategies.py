"""pytest-benchmark suites: per-hook micro-benchmarks and end-to-end decoding per strategy.

Run (not part of the default test run; ``docs/benchmarks/index.md`` has the workflow)::

    python -m pytest benchmarks/test_bench_strategies.py --benchmark-json benchmarks/results/pytest-benchmark.json
    python -m pytest benchmarks/test_bench_strategies.py --benchmark-autosave   # keep a run under .benchmarks/
    python -m pytest benchmarks/test_bench_strategies.py --benchmark-compare    # against the last saved run

Micro-benchmarks time one call of each decoding hook: every commit rule's
``dloom_select_commit`` on a (64, 32) block of random confidences, and Spiffy's
``dloom_draft``, ``dloom_prune``, ``dloom_build_mask`` and ``dloom_verify`` on the arguments
of a real decode (captured from its first verification). End-to-end benchmarks decode 32
held-out prompts per strategy on the toy zoo's ``toy-dllm`` when its weights are present,
else on a tiny random model; each records NFE, tokens per forward and hook shares in
``extra_info`` so the JSON carries them next to the timings.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from dloom import BlockSchedule, DiffusionDecoder, ModelAdapter, hookimpl, load_model
from dloom.hooks import specs as hookspecs
from dloom.hooks.registry import get_registry
from dloom.zoo import model_path
from dloom.zoo.tasks import held_out
from dloom_plugins.spiffy import Spiffy

COMMIT_RULES = ["quota", "threshold", "factor", "frechet"]
SPECULATION_HOOKS = [hook.removeprefix("dloom_") for hook in hookspecs.SPECULATION_HOOKS]


def commit_rule(name: str):
    return get_registry().get(name).build(
        **{p.name: p.default for p in get_registry().get(name).parameters}
    )


@pytest.mark.parametrize("name", COMMIT_RULES)
def test_select_commit(benchmark, name):
    """One ``dloom_select_commit`` call on a (64, 32) block of random confidences."""
    generator = torch.Generator().manual_seed(0)
    confidence = torch.rand(64, 32, dtype=torch.float64, generator=generator)
    selectable = torch.rand(64, 32, generator=generator) < 0.7
    schedule = BlockSchedule(0, 32, selectable.sum(-1))
    rule = commit_rule(name)
    commit = benchmark(rule.dloom_select_commit, confidence=confidence, selectable=selectable, schedule=schedule)
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


def prompts_for(model: ModelAdapter) -> list:
    """32 held-out task prompts, or random ids for a model without a tokenizer."""
    return [e.prompt for e in held_out(32)] if model.tokenizer is not None else [[5, 6, 7, 8]] * 32


def decoder_for(model: ModelAdapter, strategy: str) -> DiffusionDecoder:
    """A decoder; on the tiny random model Spiffy warns that it has no calibrated graph."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DiffusionDecoder(model, strategy)


class FirstCalls:
    """A ``wrapper=True`` plugin keeping the arguments of the first call of each
    speculation hook (the state's tokens copied, since the decoder updates them in place)."""

    def __init__(self) -> None:
        self.calls: dict[str, dict] = {}

    def _keep(self, hook: str, **arguments) -> None:
        if hook not in self.calls:
            if "state" in arguments:
                state = arguments["state"]
                arguments["state"] = dataclasses.replace(state, tokens=state.tokens.clone())
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
def speculation(model) -> tuple[Spiffy, dict[str, dict]]:
    """Spiffy over threshold 0.9, configured by a decoder, and the arguments its four
    speculation hooks received in a real decode."""
    decoder = decoder_for(model, "spiffy+threshold")
    first = FirstCalls()
    decoder.pm.register(first)
    decoder.generate(prompts_for(model))
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


@pytest.mark.parametrize("name", [*COMMIT_RULES, "spiffy+quota", "spiffy+threshold"])
def test_decode(benchmark, model, name):
    """Decode 32 held-out prompts (or random ids without a tokenizer) with each strategy."""
    decoder = decoder_for(model, name)
    result = benchmark.pedantic(decoder.generate, args=(prompts_for(model),), rounds=3, warmup_rounds=1)
    benchmark.extra_info.update(
        model=model.name, nfe_mean=float(result.nfe.double().mean()), tpf=result.tpf,
        hook_share=result.hook_share, speculation=result.speculation,
    )
