"""FailFast (arXiv 2512.20573): a dLLM drafts for an autoregressive target, losslessly.

The strategy's object is a :class:`dloom.failfast.FailFastSettings`; it implements no
decoding hook, because it does not run inside :class:`dloom.DiffusionDecoder`: its
registration names the ``"ar-target"`` decoder (:mod:`dloom.decoding`), which
:class:`dloom.failfast.FailFastDecoder` is (``dloom generate --strategy failfast --target
toy-ar --drafter toy-dllm``). The algorithm is described in ``docs/strategies/failfast.md``.
"""

from __future__ import annotations

from dloom import Claim, Parameter, StrategyRegistration, hookimpl
from dloom.failfast import POLICIES, VERIFICATIONS, FailFastSettings

DEFAULTS = FailFastSettings()


@hookimpl
def dloom_register_strategies(register) -> None:
    register(
        StrategyRegistration(
            name="failfast",
            plugin_class=FailFastSettings,
            parameters=(
                Parameter("tau", DEFAULTS.tau, float,
                          "fail fast: stop drafting when a confidence among the first L is below tau",
                          low=0.0, high=1.0),
                Parameter("n", DEFAULTS.n, int, "win big: grow the draft length L by n", low=1),
                Parameter("n_max", DEFAULTS.n_max, int, "most draft tokens per round (failfast policy)", low=1),
                Parameter("initial_length", DEFAULTS.initial_length, int,
                          "draft length L at the start of a round (<= n_max)", low=1),
                Parameter("policy", DEFAULTS.policy, str,
                          "failfast (fail fast, win big) or naive (fixed naive_length)", choices=POLICIES),
                Parameter("naive_length", DEFAULTS.naive_length, int, "draft length of the naive policy", low=1),
                Parameter("drafter_strategy", DEFAULTS.drafter_strategy, str,
                          "the drafter's commit rule (a registered strategy: threshold, quota, factor, frechet)"),
                Parameter("drafter_tau", DEFAULTS.drafter_tau, float,
                          "tau of the drafter's commit rule, when it has one (threshold)",
                          low=0.0, high=1.0, low_open=True, high_open=True),
                Parameter("small_block", DEFAULTS.small_block, int,
                          "draft positions denoised together, left to right (1: strictly in order)", low=1),
                Parameter("verification", DEFAULTS.verification, str,
                          "match (sample the target, accept while equal: exact for any drafter) or "
                          "ratio (min(1, p/q) rejection sampling: needs small_block=1)",
                          choices=VERIFICATIONS),
            ),
            guarantee=(
                "lossless against the AR target: greedy output equals the target's greedy tokens; "
                "sampled output has the target's own distribution (any drafter with match "
                "verification; ratio verification only for left-to-right drafts)"
            ),
            summary="FailFast: a dLLM drafts dynamic-length chunks, an AR target verifies them",
            decoder="ar-target",
            claim=Claim(
                "lossless", against="target",
                conditions=(
                    "runs with an AR target (FailFastDecoder, --target/--drafter), not inside a "
                    "diffusion decoder; every temperature"
                ),
            ),
        )
    )
