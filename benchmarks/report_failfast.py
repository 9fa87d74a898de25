"""FailFast in the report: the report's dLLM drafts for an AR target, against the target
decoding alone and against ``transformers``' assisted generation with a small AR assistant.

Greedy, one prompt at a time (the latency setting of speculative decoding), on the report's
held-out prompts, ``max_new_tokens`` the dLLM's generation length. Target forwards are counted
by forward hooks on each model (:class:`bench_failfast.ForwardClock`), prefill included,
for every method alike; AR decoding is :func:`bench_failfast.ar_decode` (one cached forward
per token). FailFast runs with the drafter's prefix cache, as
``benchmarks/bench_failfast.py``'s ``failfast`` method does, and its defaults but one: it is
measured once per drafter commit threshold of ``drafter_taus`` (method ``failfast@<tau>``).
The paper's 0.05 commits a small block in about one forward, which suits a drafter that gets
it right that way; a small drafter may draft longer accepted runs when it commits only what
it is sure of.

Wall time: every method decodes every prompt ``repeats`` times, the methods interleaved pass
by pass, and a method's seconds are the median pass. Latency model (the paper's): a method's
modelled time is its drafter (or assistant) forwards × the cost of one of them plus its
target forwards × the cost of one target decode step, each cost the mean seconds of that
model's forwards as measured in this run (target: in AR decoding; drafter: in FailFast;
assistant: in assisted generation), their ratio stated. The drafter τ the targets use is the
lossless one with the least wall time (:func:`choose_best`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from benchmarks.bench_failfast import ForwardClock, ar_decode, cut
from dloom import load_model
from dloom.ar.target import ARTarget
from dloom.errors import ModelError
from dloom.zoo.tasks import Example, TaskFamily
from dloom_plugins.failfast import FailFastDecoder

Method = Callable[[list[int]], list[int]]


def failfast_method(drafter_tau: float) -> str:
    """The method name of FailFast with the drafter commit threshold ``drafter_tau`` (its
    shortest exact spelling, so distinct thresholds have distinct names)."""
    return f"failfast@{drafter_tau!r}"


CHOSEN_BY = "wall_seconds"
"""What :func:`measure_failfast` picks the drafter τ by: the least wall time."""


def choose_best(results: Mapping[str, Mapping[str, Any]], names: Sequence[str], key: str = "target_forwards") -> str:
    """Of the FailFast methods ``names`` (measured in ``results``), the one with the least
    ``key`` (target forwards, or wall seconds) among those whose outputs all equal AR
    decoding's; the first of ``names`` when none does (a lossy FailFast is never the one the
    targets use when a lossless one ran)."""
    lossless = [name for name in names if results[name]["identical_to_ar"] == 1.0]
    return min(lossless, key=lambda name: results[name][key]) if lossless else names[0]


def methods(target, failfasts: Mapping[str, FailFastDecoder], assistant, max_new_tokens: int) -> dict[str, Method]:
    """``name -> (prompt ids -> generated ids)``: ``ar``, each of ``failfasts`` (by method
    name) and, with an ``assistant``, ``assisted``."""
    ar_target = ARTarget(target)
    eos = list(target.eos_token_ids)

    def assisted(prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt], device=target.device)
        out = target.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=target.pad_token_id, eos_token_id=eos, assistant_model=assistant.model,
        )
        return out[0, len(prompt):].tolist()

    def drafted(failfast: FailFastDecoder) -> Method:
        return lambda prompt: failfast.generate([prompt]).token_lists[0]

    found: dict[str, Method] = {
        "ar": lambda prompt: ar_decode(ar_target, prompt, max_new_tokens),
        **{name: drafted(failfast) for name, failfast in failfasts.items()},
    }
    if assistant is not None:
        found["assisted"] = assisted
    return found


def run_method(
    method: Method, prompts: Sequence[list[int]], clocks: Mapping[str, ForwardClock], eos: tuple[int, ...],
) -> tuple[list[list[int]], dict[str, int], dict[str, float], float]:
    """Every prompt's output (cut after its first EOS), the forwards each clocked model made
    and their seconds, and the wall seconds."""
    before = {name: (clock.count, clock.seconds) for name, clock in clocks.items()}
    started = time.perf_counter()
    outputs = [cut(method(list(prompt)), eos) for prompt in prompts]
    seconds = time.perf_counter() - started
    return (outputs, {name: clock.count - before[name][0] for name, clock in clocks.items()},
            {name: clock.seconds - before[name][1] for name, clock in clocks.items()}, seconds)


def check_models(drafter, target_name: str, assistant_name: str | None, dtype: str = "float32") -> None:
    """Refuse, before any measurement, the models :func:`measure_failfast` cannot compare: a
    target or assistant that does not load, a target FailFast refuses ``drafter`` for (another
    vocabulary), or an assistant whose tokenizer is not the target's (assisted generation
    drafts the target's token ids).

    :raises ModelError: naming the model and what is wrong with it.
    """
    target = load_model(target_name, dtype=dtype, device=drafter.device, require_mask=False)
    FailFastDecoder(target, drafter, max_new_tokens=drafter.default_gen_length or 128)
    if assistant_name is not None:
        assistant = load_model(assistant_name, dtype=dtype, device=drafter.device, require_mask=False)
        if assistant.tokenizer_sha256 != target.tokenizer_sha256:
            raise ModelError(f"assistant {assistant_name!r} does not share target {target_name!r}'s tokenizer; "
                             "assisted generation needs one vocabulary (e.g. the zoo's long-ar-small for long-ar)")


def measure_failfast(
    drafter, target_name: str, assistant_name: str | None, examples: Sequence[Example],
    families: Mapping[str, TaskFamily], drafter_taus: Sequence[float], dtype: str = "float32", repeats: int = 3,
) -> dict[str, Any]:
    """FailFast with ``drafter`` (the report's dLLM adapter) for ``target_name`` at each of
    ``drafter_taus``, against AR decoding and assisted generation with ``assistant_name``
    (``None``: skipped), graded with ``families``' checkers, each method ``repeats`` times
    (interleaved). Per method: accuracy, target forwards (per prompt, per generated token),
    helper forwards, tokens per target forward, TPS, wall seconds (median pass) and its
    speed-up over AR decoding, modelled seconds and speed-up (the latency model of the module
    docstring), and the share of outputs identical to AR decoding's; ``best`` names the
    FailFast method the targets use (:func:`choose_best` by :data:`CHOSEN_BY`)."""
    if repeats < 1:
        raise ValueError(f"repeats is {repeats}; allowed: 1 or more passes")
    device = drafter.device
    target = load_model(target_name, dtype=dtype, device=device, require_mask=False)
    assistant = None if assistant_name is None else load_model(
        assistant_name, dtype=dtype, device=device, require_mask=False)
    clocks = {"target": ForwardClock(target.model), "drafter": ForwardClock(drafter.model)}
    if assistant is not None:
        clocks["assistant"] = ForwardClock(assistant.model)
    max_new_tokens = drafter.default_gen_length or 128
    prompts = target.encode([e.prompt for e in examples])
    eos = target.eos_token_ids
    failfasts = {
        failfast_method(tau): FailFastDecoder(target, drafter, max_new_tokens=max_new_tokens, drafter_cache="prefix",
                                              drafter_tau=tau)
        for tau in drafter_taus
    }
    runs: dict[str, list[tuple[list[list[int]], dict[str, int], dict[str, float], float]]] = {}
    for _ in range(repeats):
        for name, method in methods(target, failfasts, assistant, max_new_tokens).items():
            runs.setdefault(name, []).append(run_method(method, prompts, clocks, eos))
    reference = runs["ar"][0][0]
    results: dict[str, dict[str, Any]] = {}
    for name, passes in runs.items():
        outputs, forwards = passes[0][0], passes[0][1]
        generated = sum(len(o) for o in outputs)
        answers = [target.decode([t for t in o if t not in eos]) for o in outputs]
        helper = {"ar": None, "assisted": "assistant"}.get(name, "drafter")
        seconds = statistics.median(p[3] for p in passes)
        results[name] = {
            "accuracy": sum(families[e.family].check(e.prompt, a) for e, a in zip(examples, answers)) / len(examples),
            "generated_tokens": generated,
            "target_forwards": forwards["target"],
            "target_forwards_per_prompt": forwards["target"] / len(examples),
            "target_forwards_per_token": forwards["target"] / generated,
            "tokens_per_target_forward": generated / forwards["target"],
            "helper": helper,
            "helper_forwards": forwards[helper] if helper else 0,
            "tps": generated / seconds,
            "wall_seconds": seconds,
            "identical_to_ar": min(sum(a == b for a, b in zip(p[0], reference)) for p in passes) / len(examples),
        }
    latency = forward_costs(runs)
    for entry in results.values():
        helper = entry["helper"]
        entry["modelled_seconds"] = (entry["target_forwards"] * latency["target"]
                                     + (entry["helper_forwards"] * latency[helper] if helper else 0.0))
    base = results["ar"]
    for entry in results.values():
        entry["wall_speedup_vs_ar"] = base["wall_seconds"] / entry["wall_seconds"]
        entry["modelled_speedup_vs_ar"] = base["modelled_seconds"] / entry["modelled_seconds"]
    for name, failfast in failfasts.items():
        totals = failfast.totals()
        results[name].update(drafter_tau=failfast.settings.drafter_tau, rounds=totals["rounds"] // repeats,
                             accepted_per_round=totals["accepted_per_round"])
    best = choose_best(results, list(failfasts), CHOSEN_BY)
    return {
        "target": target_name, "drafter": drafter.name, "assistant": assistant_name,
        "max_new_tokens": max_new_tokens, "batch_size": 1, "n": len(examples), "repeats": repeats,
        "latency": {**latency, "ratio": latency["drafter"] / latency["target"]},
        "chosen_by": "wall time", "methods": results, "best": best,
    }


def forward_costs(runs: Mapping[str, Sequence[tuple[Any, dict[str, int], dict[str, float], float]]]) -> dict[str, float]:
    """Mean seconds of one forward per model, from the passes of the method that uses it the
    way the latency model charges it: the target's decode steps in ``ar``, the drafter's in
    the FailFast methods, the assistant's in ``assisted`` (absent without it)."""
    def mean(names: Sequence[str], model: str) -> float:
        count = sum(p[1][model] for name in names for p in runs[name])
        return sum(p[2][model] for name in names for p in runs[name]) / count if count else 0.0

    costs = {"target": mean(["ar"], "target"),
             "drafter": mean([n for n in runs if n.startswith("failfast@")], "drafter")}
    if "assisted" in runs:
        costs["assistant"] = mean(["assisted"], "assistant")
    return costs


def break_even_cost_ratio(ar: Mapping[str, Any], method: Mapping[str, Any], speedup: float) -> float | None:
    """The drafter/target forward cost ratio at which ``method`` reaches ``speedup`` over
    ``ar`` in the latency model, with the forwards this run counted.

    The model charges AR decoding ``A·c_target`` and FailFast ``R·c_target + H·c_drafter``
    (``A``, ``R``: target forwards, ``H``: drafter forwards); the speed-up ``A / (R + H·r)``
    reaches ``speedup`` when ``r = c_drafter / c_target <= (A / speedup - R) / H``.

    :return: that largest ratio; ``None`` when even a free drafter (``r = 0``) falls short, or
        when the method made no drafter forward (its speed-up does not depend on ``r``).
    """
    if speedup <= 0:
        raise ValueError(f"speedup {speedup!r}: allowed: a positive number")
    helper_forwards = method["helper_forwards"]
    room = ar["target_forwards"] / speedup - method["target_forwards"]
    if helper_forwards == 0 or room < 0:
        return None
    return room / helper_forwards
