"""Checks of a ``lossless against target`` claim: a strategy run in the ``"ar-target"``
decoder (:mod:`dloom.decode.decoders`; FailFast) must produce the AR target's own output.

* :func:`target_greedy`: the target's greedy decoding, one uncached forward per token (the
  reference of the greedy check).
* :func:`target_distribution`: the exact distribution of the target's sampled output
  (``softmax(logits / T)`` at every step, EOS ends a sequence), by enumeration.
* :func:`compare_target_greedy`: a decoder's greedy outputs against the target's, on the toy
  zoo's ``toy-ar`` and ``toy-dllm`` when installed, else on a tiny random pair
  (:func:`greedy_pair`).
* :func:`target_sampling_test`: the pooled chi-square test of the sampled outputs on tiny
  enumerable pairs, with the verdict rules of :mod:`dloom.check.sampling`.

:func:`dloom.check.report.check_lossless` runs both for ``against="target"``.

Outputs are token tuples up to and including the first EOS (or ``max_new_tokens`` tokens).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch

from dloom.ar.decoder import ARTargetDecoder
from dloom.check import tiny
from dloom.check.enumerate import Output
from dloom.check.greedy import GreedyComparison, compare_outputs
from dloom.check.progress import stage
from dloom.check.sampling import (
    SamplingOptions,
    SamplingTest,
    SeedResult,
    conclude,
    seed_result,
)
from dloom.decode.decoders import Decoder
from dloom.errors import ConfigurationError
from dloom.model.adapter import ModelAdapter

MAX_OUTPUTS = 20_000
TINY_GREEDY = {"vocab": 16, "hidden": 32, "layers": 2, "init": 0.8, "context": 64}
"""The tiny pair of the greedy check when the toy zoo's AR models are not installed."""
TINY_SAMPLING = {"vocab": 6, "max_new_tokens": 3}
"""The tiny enumerable pair of the sampling test: 6 tokens, at most 3 generated."""


def target_greedy(target: ModelAdapter, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """The target's greedy output per prompt: argmax of an uncached forward per token.

    :return: one token list per prompt, up to and including the first EOS.
    """
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=target.device)
        tokens: list[int] = []
        for _ in range(max_new_tokens):
            logits = target.raw_logits(ids)[0, -1]
            token = int(torch.argmax(logits.to(torch.float64)))
            tokens.append(token)
            if token in target.eos_token_ids:
                break
            ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
        outputs.append(tokens)
    return outputs


def target_distribution(
    target: ModelAdapter, prompt: Sequence[int], max_new_tokens: int, temperature: float
) -> dict[Output, float]:
    """The exact distribution of the target's sampled output on ``prompt``.

    One batched forward per generated length over every live prefix; an output ends at the
    first EOS or after ``max_new_tokens`` tokens.

    :raises ConfigurationError: ``temperature <= 0`` or more than :data:`MAX_OUTPUTS` prefixes.
    """
    if temperature <= 0:
        raise ConfigurationError(f"temperature is {temperature}; allowed: > 0 (greedy has one output)")
    eos = set(target.eos_token_ids)
    live: dict[Output, float] = {(): 1.0}
    final: dict[Output, float] = {}
    for _ in range(max_new_tokens):
        if len(live) > MAX_OUTPUTS:
            raise ConfigurationError(
                f"{len(live)} live prefixes; allowed: at most {MAX_OUTPUTS} (fewer tokens or a smaller vocabulary)"
            )
        prefixes = list(live)
        ids = torch.tensor([list(prompt) + list(p) for p in prefixes], dtype=torch.long, device=target.device)
        logits = target.raw_logits(ids)[:, -1].to(torch.float64)
        probs = torch.softmax(logits / temperature, dim=-1).tolist()
        grown: dict[Output, float] = {}
        for prefix, row in zip(prefixes, probs):
            for token, p in enumerate(row):
                if p > 0.0:
                    out = prefix + (token,)
                    (final if token in eos else grown)[out] = live[prefix] * p
        live = grown
    final.update(live)
    return final


def greedy_pair(prompt_count: int, max_new_tokens: int | None) -> tuple[ModelAdapter, ModelAdapter, list[list[int]], int, list[str]]:
    """The greedy check's target, drafter, prompts (token ids), generation length and notes:
    the toy zoo's ``toy-ar`` and ``toy-dllm`` in float64 on held-out task prompts when
    installed, else a tiny random pair (:data:`TINY_GREEDY`) on random prompts."""
    if tiny.zoo_installed("toy-ar", "toy-dllm"):
        from dloom.model.adapter import load_model
        from dloom.zoo.tasks import GEN_LENGTH, held_out

        target = load_model("toy-ar", dtype="float64", require_mask=False)
        drafter = load_model("toy-dllm", dtype="float64")
        prompts = target.encode([example.prompt for example in held_out(prompt_count)])
        return target, drafter, prompts, max_new_tokens or GEN_LENGTH, []
    settings: dict[str, Any] = dict(TINY_GREEDY)
    target, drafter = tiny.tiny_ar(0, **settings), tiny.tiny_dllm(0, **settings)
    prompts = tiny.tiny_prompts(prompt_count, vocab=settings["vocab"], length=4, seed=0)
    note = (
        "toy-ar / toy-dllm weights are not installed: the greedy check ran on a tiny random "
        f"pair (vocab {settings['vocab']}, float64)"
    )
    return target, drafter, prompts, max_new_tokens or 12, [note]


def compare_target_greedy(
    make_decoder: Callable[..., Decoder], target: ModelAdapter, drafter: ModelAdapter,
    prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int = 32,
) -> GreedyComparison:
    """Greedy outputs of ``make_decoder(target, drafter, max_new_tokens=..., temperature=0)``
    against :func:`target_greedy`."""
    decoder = make_decoder(target, drafter, max_new_tokens=max_new_tokens, temperature=0.0)
    identical, first = compare_outputs(
        lambda chunk: decoder.generate(chunk).token_lists,
        lambda chunk: target_greedy(target, chunk, max_new_tokens),
        [list(p) for p in prompts], batch_size,
    )
    return GreedyComparison(
        prompts=len(prompts), identical=identical, first_difference=first,
        model=f"{target.name} (drafter {drafter.name})", dtype=str(target.dtype).removeprefix("torch."),
        settings={"max_new_tokens": max_new_tokens},
    )


def sampling_seed(
    make_decoder: Callable[..., Decoder], seed: int, *, vocab: int = TINY_SAMPLING["vocab"],
    max_new_tokens: int = TINY_SAMPLING["max_new_tokens"], **values: Any,
) -> SeedResult:
    """One tiny enumerable pair's chi-square test: ``samples`` sampled outputs of the decoder
    (one batch, rows independent) against :func:`target_distribution`.

    The pair is ``tiny_ar(seed)`` and ``tiny_dllm(seed)`` (``vocab`` tokens), the prompt
    ``tiny_prompts(1, seed=seed)``; the decoder's sampler is seeded with ``seed``.

    :param values: fields of :class:`~dloom.check.sampling.SamplingOptions` (``temperature``,
        ``samples``, ``alpha``, ``seeds``, ``epsilon``).
    """
    options = SamplingOptions(**values)
    target, drafter = tiny.tiny_ar(seed, vocab=vocab), tiny.tiny_dllm(seed, vocab=vocab)
    prompt = tiny.tiny_prompts(1, vocab=vocab, seed=seed)[0]
    exact = target_distribution(target, prompt, max_new_tokens, options.temperature)
    decoder = make_decoder(
        target, drafter, max_new_tokens=max_new_tokens, temperature=options.temperature, seed=seed
    )
    counts = Counter(tuple(row) for row in decoder.generate([prompt] * options.samples).token_lists)
    model = f"{target.name} (drafter {drafter.name})"
    return seed_result(seed, model, prompt, {"max_new_tokens": max_new_tokens}, counts, exact, options)


def target_sampling_test(make_decoder: Callable[..., Decoder], options: SamplingOptions) -> SamplingTest:
    """:func:`sampling_seed` on ``options.seeds`` tiny pairs, and the verdict."""
    results = []
    for seed in range(options.seeds):
        stage(f"sampling test against the AR target: seed {seed + 1} of {options.seeds}")
        results.append(sampling_seed(make_decoder, seed, **asdict(options)))
    return conclude(results, options)


def ar_target_factory(spec: Any, params: Mapping[str, Any] | None = None) -> Callable[..., Decoder]:
    """``make_decoder`` for a strategy spec that runs in the ``"ar-target"`` decoder (a name
    or the strategy's object): a :class:`dloom.ar.decoder.ARTargetDecoder`."""

    def make(target: ModelAdapter, drafter: ModelAdapter, **settings: Any) -> Decoder:
        return ARTargetDecoder(target, spec, drafter=drafter, params=dict(params or {}), **settings)

    return make
