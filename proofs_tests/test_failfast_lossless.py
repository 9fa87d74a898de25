"""FailFast is lossless against its AR target (``docs/strategies/failfast.md``, "Guarantee").

* Greedy: the output is the target's own greedy decoding, token for token, compared with an
  uncached one-token-per-forward loop and with ``transformers`` ``generate(do_sample=False)``,
  for both length policies, every built-in drafter commit rule and Spiffy over three of them
  (a speculating drafter), both drafter cache modes and left-padded batches; on tiny random float64 pairs always, and on the toy zoo's ``toy-ar`` /
  ``toy-dllm`` (held-out task prompts) when they are installed.
* Sampling: on tiny enumerable pairs (vocabulary 6, at most 3 generated tokens) the exact
  distribution of the target's own sampled output is enumerated and 20,000 FailFast samples
  (one batch, rows independent) are compared with it by a pooled Pearson chi-square test at
  significance ``ALPHA = 1e-3``, Bonferroni-corrected over the cases (``p >= ALPHA / cases``
  to pass), with power >= 0.8 against every alternative at total-variation distance 0.05.
* Negative control: ratio-based rejection sampling (``min(1, p/q)``) on drafts a dLLM
  committed out of order (forced with ``unsafe_ratio_out_of_order``) is biased, and the same
  detector rejects it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dloom.check.sampling import _verdict
from dloom.check.target import (
    ar_target_factory,
    sampling_seed,
    target_distribution,
    target_greedy,
)
from dloom.check.tiny import tiny_ar, tiny_dllm
from dloom.decode.kernel import REMASKING
from dloom.errors import ConfigurationError
from dloom_plugins.failfast import FailFastDecoder

ALPHA = 1e-3
EPSILON = 0.05
SAMPLES = 20_000
PAIR = dict(vocab=16, hidden=32, layers=2, init=0.8, context=64)
PROMPTS = [[5, 6, 7, 8], [9, 3], [3, 4, 5], [7, 8, 9, 10, 11], [12, 4, 4], [6, 13]]
SMALL = dict(initial_length=3, n=2, n_max=9, naive_length=4, small_block=4)


@pytest.fixture(scope="module")
def pair():
    return tiny_ar(1, **PAIR), tiny_dllm(1, **PAIR)


@pytest.fixture(scope="module")
def reference(pair):
    """The target's greedy outputs on ``PROMPTS`` (16 tokens), checked against ``generate``."""
    target = pair[0]
    outputs = target_greedy(target, PROMPTS, 16)
    assert outputs == generate_greedy(target, PROMPTS, 16)
    return outputs


def generate_greedy(target, prompts, max_new_tokens):
    """``transformers`` greedy generation per prompt, cut after the first EOS."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = target.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=target.pad_token_id, eos_token_id=list(target.eos_token_ids),
        )[0, len(prompt):].tolist()
        ends = [i for i, t in enumerate(out) if t in target.eos_token_ids]
        outputs.append(out[: ends[0] + 1] if ends else out)
    return outputs


def fixed_budget(drafter_strategy: str) -> str:
    """A speculating drafter at a fixed budget: ``budget=auto`` takes no drafts from the tiny
    drafter's uncalibrated graph."""
    return "spiffy.budget=10" if drafter_strategy.startswith("spiffy") else ""


@pytest.mark.filterwarnings("ignore:no built-in draft graph")
@pytest.mark.parametrize("policy", ["failfast", "naive"])
@pytest.mark.parametrize(
    "drafter_strategy",
    ["threshold", "quota", "factor", "frechet", "spiffy+threshold", "spiffy+quota", "spiffy+frechet"],
)
def test_greedy_output_is_the_targets_greedy_output(pair, reference, policy, drafter_strategy):
    target, drafter = pair
    decoder = FailFastDecoder(
        target, drafter, params=dict(SMALL, policy=policy, drafter_strategy=drafter_strategy,
                                     drafter_params=fixed_budget(drafter_strategy)),
        max_new_tokens=16, drafter_cache="prefix" if "threshold" in drafter_strategy else "none",
    )
    assert decoder.generate(PROMPTS).token_lists == reference


@pytest.mark.filterwarnings("ignore:no built-in draft graph")
@settings(max_examples=8, deadline=None)
@given(
    tau=st.floats(0.0, 1.0), n=st.integers(1, 6), n_max=st.integers(1, 14), initial=st.integers(1, 8),
    small_block=st.integers(1, 9),
    rule=st.sampled_from(["threshold", "quota", "factor", "frechet", "spiffy+threshold", "spiffy+quota"]),
    drafter_tau=st.floats(0.01, 0.99), cache=st.sampled_from(["none", "prefix"]),
    policy=st.sampled_from(["failfast", "naive"]), verification=st.sampled_from(["match", "ratio"]),
    remasking=st.sampled_from(REMASKING),
)
def test_greedy_identity_holds_for_any_setting(
    pair, reference, tau, n, n_max, initial, small_block, rule, drafter_tau, cache, policy, verification, remasking
):
    target, drafter = pair
    params = dict(
        tau=tau, n=n, n_max=n_max, initial_length=min(initial, n_max), small_block=small_block,
        drafter_strategy=rule, drafter_tau=drafter_tau, policy=policy, naive_length=initial,
        verification=verification, drafter_params=fixed_budget(rule),
    )
    decoder = FailFastDecoder(
        target, drafter, params=params, max_new_tokens=12, drafter_cache=cache, remasking=remasking, seed=0,
        unsafe_ratio_out_of_order=True,  # temperature 0: ratio verification is the greedy rule
    )
    assert decoder.generate(PROMPTS[:4]).token_lists == [r[:12] for r in reference[:4]]


def _zoo_installed() -> bool:
    from dloom import zoo

    return all((zoo.model_path(m) / "model.safetensors").exists() for m in ("toy-ar", "toy-dllm"))


ZOO = pytest.mark.skipif(not _zoo_installed(), reason="toy-ar / toy-dllm weights are not installed")


def _zoo_pair():
    from dloom.model.adapter import load_model

    target = load_model("toy-ar", dtype="float64", require_mask=False)
    return target, load_model("toy-dllm", dtype="float64")


@ZOO
def test_greedy_output_on_the_toy_zoo_is_the_targets():
    from dloom.zoo.tasks import GEN_LENGTH, held_out

    target, drafter = _zoo_pair()
    prompts = [e.prompt for e in held_out(7)]  # one held-out prompt per task family
    reference = generate_greedy(target, target.encode(prompts), GEN_LENGTH)
    result = FailFastDecoder(target, drafter, max_new_tokens=GEN_LENGTH, drafter_cache="prefix").generate(prompts)
    assert result.token_lists == reference


@ZOO
@pytest.mark.slow
def test_greedy_output_on_the_toy_zoo_is_the_zoos_own_ar_decoding():
    from dloom.zoo.tasks import GEN_LENGTH, held_out
    from dloom_training.decoding import decode_ar

    target, drafter = _zoo_pair()
    prompts = [e.prompt for e in held_out(28)]
    texts = decode_ar(target.model, prompts)  # the zoo's own evaluation decoding
    reference = generate_greedy(target, target.encode(prompts), GEN_LENGTH)
    for params in ({}, {"policy": "naive", "naive_length": 8, "drafter_tau": 0.9},
                   {"drafter_strategy": "frechet", "small_block": 4}):
        result = FailFastDecoder(target, drafter, params=params, max_new_tokens=GEN_LENGTH).generate(prompts)
        assert result.token_lists == reference
        assert result.texts == texts


def test_the_enumerated_target_distribution_is_a_distribution():
    target = tiny_ar(0, vocab=6)
    exact = target_distribution(target, [3, 4, 5], 3, 1.0)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-12)
    assert all(len(o) == 3 or o[-1] == 2 for o in exact)
    assert len(exact) == 1 + 5 + 25 + 125  # EOS at 1, 2, 3 or no EOS in 3 tokens


SAMPLING_CASES = [
    ("match, threshold drafter, fail fast / win big", 0, 1.0, dict(initial_length=1, n=1, n_max=2, small_block=2)),
    pytest.param(
        "match, quota drafter, naive", 1, 0.7,
        dict(policy="naive", naive_length=2, drafter_strategy="quota", small_block=3),
        marks=pytest.mark.slow,  # ~10 s on two busy cores; the other two cases cover match and ratio
    ),
    ("ratio, strictly left-to-right drafter", 2, 1.0, dict(verification="ratio", small_block=1, initial_length=1, n=1, n_max=3)),
    pytest.param(
        "match, speculating drafter (spiffy+quota), fail fast / win big", 3, 1.0,
        dict(initial_length=2, n=1, n_max=3, small_block=3, drafter_strategy="spiffy+quota",
             drafter_params="spiffy.budget=10"),
        marks=pytest.mark.slow,  # ~20 s on two busy cores
    ),
]


@pytest.mark.filterwarnings("ignore:no built-in draft graph")
@pytest.mark.parametrize("case, seed, temperature, params", SAMPLING_CASES)
def test_sampled_outputs_have_the_targets_distribution(case, seed, temperature, params):
    result = sampling_seed(
        ar_target_factory("failfast", params), seed, temperature=temperature, samples=SAMPLES,
        alpha=ALPHA, seeds=len(SAMPLING_CASES), epsilon=EPSILON,
    )
    assert not result.impossible
    assert result.p_value >= ALPHA / len(SAMPLING_CASES), f"{case}: p = {result.p_value:.3g}"
    assert result.power >= 0.8


def test_ratio_sampling_of_out_of_order_drafts_is_biased_and_detected():
    """Quota commits the most confident of 3 masked positions first, so a later token is often
    drafted before an earlier one and ``q_i`` is conditioned on it: the ratio test's
    accept/resample rule then no longer yields the target's distribution."""
    params = dict(verification="ratio", small_block=3, drafter_strategy="quota", initial_length=3, n_max=3)

    def make(target, drafter, **settings):
        return FailFastDecoder(target, drafter, params=params, unsafe_ratio_out_of_order=True, **settings)

    result = sampling_seed(make, 0, temperature=1.0, samples=SAMPLES, alpha=ALPHA, seeds=1, epsilon=EPSILON)
    assert result.p_value < ALPHA
    verdict, reason = _verdict([result], ALPHA, EPSILON, 0.8)
    assert verdict == "not lossless", reason
    with pytest.raises(ConfigurationError, match="strictly left to right"):  # without the test-only switch
        FailFastDecoder(tiny_ar(0, vocab=6), tiny_dllm(0, vocab=6), params=params)
