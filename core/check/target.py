"""Checks of a ``lossless against target`` claim: a speculative decoder of an AR target
(FailFast) must produce the target's own output.

* :func:`target_greedy`: the target's greedy decoding, one uncached forward per token (the
  reference of the greedy check).
* :func:`target_distribution`: the exact distribution of the target's sampled output
  (``softmax(logits / T)`` at every step, EOS ends a sequence), by enumeration.
* :func:`check_target_lossless`: greedy identity on tiny random model pairs (or the toy zoo's
  ``toy-ar`` and ``toy-dllm`` when installed), then the pooled chi-square test of the sampled
  outputs on tiny enumerable pairs, with the verdict rules of :mod:`dloom.check.sampling`.

Outputs are token tuples up to and including the first EOS (or ``max_new_tokens`` tokens).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from dloom.adapter import ModelAdapter
from dloom.check.sampling import SeedResult, _verdict, replicates
from dloom.check.stats import pooled_chi_square, power
from dloom.check.tiny import tiny_ar, tiny_dllm, tiny_prompts
from dloom.errors import ConfigurationError

Output = tuple[int, ...]
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
            with torch.no_grad():
                logits = target.model(input_ids=ids).logits[0, -1]
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
        with torch.no_grad():
            logits = target.model(input_ids=ids).logits[:, -1].to(torch.float64)
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


def _zoo_pair_available() -> bool:
    from dloom import zoo

    return all((zoo.model_path(name) / "model.safetensors").exists() for name in ("toy-ar", "toy-dllm"))


def greedy_pair(prompt_count: int, max_new_tokens: int | None) -> tuple[ModelAdapter, ModelAdapter, list[list[int]], int, list[str]]:
    """The greedy check's target, drafter, prompts (token ids), generation length and notes:
    the toy zoo's ``toy-ar`` and ``toy-dllm`` in float64 on held-out task prompts when
    installed, else a tiny random pair (:data:`TINY_GREEDY`) on random prompts."""
    if _zoo_pair_available():
        from dloom.adapter import load_model
        from dloom.zoo.tasks import GEN_LENGTH, held_out

        target = load_model("toy-ar", dtype="float64", require_mask=False)
        drafter = load_model("toy-dllm", dtype="float64")
        prompts = target.encode([example.prompt for example in held_out(prompt_count)])
        return target, drafter, prompts, max_new_tokens or GEN_LENGTH, []
    settings = dict(TINY_GREEDY)
    target, drafter = tiny_ar(0, **settings), tiny_dllm(0, **settings)
    prompts = tiny_prompts(prompt_count, vocab=settings["vocab"], length=4, seed=0)
    note = (
        "toy-ar / toy-dllm weights are not installed: the greedy check ran on a tiny random "
        f"pair (vocab {settings['vocab']}, float64)"
    )
    return target, drafter, prompts, max_new_tokens or 12, [note]


def compare_target_greedy(
    make_decoder: Callable[..., Any], target: ModelAdapter, drafter: ModelAdapter,
    prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int = 32,
) -> dict[str, Any]:
    """Greedy outputs of ``make_decoder(target, drafter, max_new_tokens=..., temperature=0)``
    against :func:`target_greedy`, as a :class:`dloom.check.greedy.GreedyComparison` JSON."""
    decoder = make_decoder(target, drafter, max_new_tokens=max_new_tokens, temperature=0.0)
    reference = target_greedy(target, prompts, max_new_tokens)
    identical, first = 0, None
    for start in range(0, len(prompts), batch_size):
        ours = decoder.generate([list(p) for p in prompts[start : start + batch_size]]).token_lists
        for offset, (x, y) in enumerate(zip(ours, reference[start : start + batch_size])):
            if list(x) == list(y):
                identical += 1
            elif first is None:
                position = next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                first = {"prompt": start + offset, "position": position, "strategy_tokens": list(x), "against_tokens": list(y)}
    return {
        "prompts": len(prompts), "identical": identical, "first_difference": first,
        "model": f"{target.name} (drafter {drafter.name})", "dtype": str(target.dtype).removeprefix("torch."),
        "settings": {"max_new_tokens": max_new_tokens},
        "agreement": identical / len(prompts) if prompts else 1.0,
    }


def sampling_seed(
    make_decoder: Callable[..., Any], seed: int, *, temperature: float, samples: int, alpha: float,
    seeds: int, epsilon: float, vocab: int = TINY_SAMPLING["vocab"],
    max_new_tokens: int = TINY_SAMPLING["max_new_tokens"],
) -> SeedResult:
    """One tiny enumerable pair's chi-square test: ``samples`` sampled outputs of the decoder
    (one batch, rows independent) against :func:`target_distribution`.

    The pair is ``tiny_ar(seed)`` and ``tiny_dllm(seed)`` (``vocab`` tokens), the prompt
    ``tiny_prompts(1, seed=seed)``; the decoder's sampler is seeded with ``seed``.
    """
    target, drafter = tiny_ar(seed, vocab=vocab), tiny_dllm(seed, vocab=vocab)
    prompt = tiny_prompts(1, vocab=vocab, seed=seed)[0]
    exact = target_distribution(target, prompt, max_new_tokens, temperature)
    decoder = make_decoder(target, drafter, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    counts: dict[Output, int] = {}
    for row in decoder.generate([prompt] * samples).token_lists:
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    test = pooled_chi_square(counts, exact, simulate_below=alpha, replicates=replicates(alpha, seeds), seed=seed)
    observed_tv = 0.5 * sum(abs(counts.get(k, 0) / samples - exact.get(k, 0.0)) for k in set(counts) | set(exact))
    return SeedResult(
        seed=seed, model=f"{target.name} (drafter {drafter.name})", prompt=prompt,
        settings={"max_new_tokens": max_new_tokens}, samples=samples, outputs=len(exact),
        bins=test.bins, pooled_mass=test.pooled_mass, statistic=test.statistic, df=test.df,
        p_value=test.p_value, p_value_asymptotic=test.p_value_asymptotic, replicates=test.replicates,
        power=power(test.df, samples, alpha, epsilon), observed_tv=observed_tv,
        impossible=[list(k) for k in test.impossible],
    )


def check_target_lossless(
    make_decoder: Callable[..., Any],
    name: str,
    *,
    claim: dict[str, Any] | None = None,
    claimed_by: str | None = None,
    prompt_count: int = 32,
    gen_length: int | None = None,
    temperature: float = 1.0,
    samples: int = 20_000,
    seeds: int = 3,
    alpha: float = 1e-3,
    epsilon: float = 0.05,
    min_power: float = 0.8,
    notes: list[str] | None = None,
):
    """Test "the decoder built by ``make_decoder(target, drafter, **settings)`` is lossless
    against the target": greedy identity (:func:`greedy_pair`, :func:`target_greedy`), then,
    when ``temperature > 0``, the sampling test on ``seeds`` tiny pairs.

    :return: a :class:`dloom.check.report.CheckReport` (verdicts as for any lossless claim).
    """
    from dloom.check.report import CheckReport

    notes = list(notes or [])
    target, drafter, prompts, length, setup_notes = greedy_pair(prompt_count, gen_length)
    notes.extend(setup_notes)
    greedy = compare_target_greedy(make_decoder, target, drafter, prompts, length)
    evidence: dict[str, Any] = {"greedy": greedy}
    report = CheckReport(name, claim, claimed_by, "", "", evidence, notes)
    if greedy["first_difference"] is not None:
        first = greedy["first_difference"]
        report.verdict = "not lossless"
        report.reason = (
            f"greedy outputs differ from the target's on {greedy['prompts'] - greedy['identical']} "
            f"of {greedy['prompts']} prompts; first at prompt {first['prompt']}, position {first['position']}"
        )
        return report
    if temperature <= 0:
        report.verdict, report.reason = "lossless", f"greedy outputs equal the target's on all {greedy['prompts']} prompts"
        notes.append("temperature 0: the sampling test was not run (pass a temperature > 0)")
        return report
    results = [
        sampling_seed(make_decoder, seed, temperature=temperature, samples=samples, alpha=alpha, seeds=seeds, epsilon=epsilon)
        for seed in range(seeds)
    ]
    verdict, reason = _verdict(results, alpha, epsilon, min_power)
    evidence["sampling"] = {
        "verdict": verdict, "reason": reason, "temperature": temperature, "alpha": alpha,
        "epsilon": epsilon, "min_power": min_power, "seeds": [vars(r) for r in results],
    }
    report.verdict = verdict
    report.reason = f"greedy outputs equal the target's on all {greedy['prompts']} prompts; sampling at T={temperature:g}: {reason}"
    return report


def failfast_factory(spec: Any, params: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """``make_decoder`` for a FailFast strategy spec (a name or a ``FailFastSettings``)."""
    from dloom.failfast import FailFastDecoder

    def make(target: ModelAdapter, drafter: ModelAdapter, **settings: Any) -> Any:
        return FailFastDecoder(target, drafter, spec, params=dict(params or {}), **settings)

    return make
