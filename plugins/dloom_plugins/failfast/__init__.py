"""FailFast: a dLLM drafts for an autoregressive target, losslessly (arXiv 2512.20573;
``docs/strategies/failfast.md``). It runs in the core's ``"ar-target"`` decoder
(:class:`dloom.ar.decoder.ARTargetDecoder`) through four hooks (:mod:`.plugin`).

Each round, per row:

1. **Draft** (``dloom_draft``, :mod:`.drafter`). The drafter (a dLLM sharing the target's tokenizer) sees one canvas per row:
   the prompt, the row's accepted tokens, then masks up to ``max_new_tokens``. It denoises
   the masks after the accepted prefix in *small blocks* (default 8 positions), left to
   right, each call one step of the drafter's own :class:`dloom.DiffusionDecoder` over
   its composition (``drafter_strategy``: any composition a diffusion decoder takes, a
   commit rule such as threshold, quota, factor, frechet, or a speculating one such as
   ``spiffy+threshold``) with block length ``small_block``: the engine's kernel step
   (:class:`dloom.decode.kernel.KernelStep`), or its speculative step
   (:class:`dloom.decode.step.SpeculativeStepper`: Spiffy's draft, prune, build_mask and
   verify over the small block, lossless against its base rule). Each committed token's
   confidence (its probability under the drafter's softmax) is recorded. The length policy (``dloom_prune``,
   :mod:`.policy`) decides when to stop:

   * ``failfast`` (fail fast, win big): start with ``L = initial_length``. Once the first
     ``L`` draft tokens are committed: if any of their confidences is below ``tau``, stop
     and propose those ``L`` tokens; else if ``L >= n_max``, stop; else ``L += n`` and keep
     denoising.
   * ``naive``: propose the first ``naive_length`` tokens.

   Both never propose past ``max_new_tokens`` nor past the first drafted EOS (the EOS itself
   is proposed).

2. **Verify** (``dloom_build_mask``, ``dloom_verify``). One target forward over the row's draft (plus the accepted tokens the
   target has not cached yet, at least the last one). With ``k`` draft tokens ``x`` and the
   target's distributions ``p_0 .. p_k`` after each prefix:

   * ``match`` (any temperature, any drafter): draw ``y_i ~ p_i`` (argmax at temperature
     0); accept draft tokens while ``y_i == x_i``; the first ``y_i`` that differs (or the
     bonus ``y_k``) is appended. Every appended token is a sample of the target given the
     tokens before it, so the output is distributed exactly as the target's own sampling
     (greedy: the target's greedy tokens).
   * ``ratio`` (speculative rejection sampling): accept ``x_i`` with probability
     ``min(1, p_i(x_i) / q_i(x_i))``, ``q_i`` the drafter distribution ``x_i`` was sampled
     from; at the first rejection sample the residual ``max(0, p_i - q_i)``; else the bonus
     from ``p_k``. Exact only when ``q_i`` is the drafter's distribution of ``x_i`` given
     exactly ``x_<i`` (tokens drafted strictly left to right). That holds with
     ``small_block == 1`` (one masked position is selectable at a time, so every commit rule
     commits it alone, in order); any other drafter commits positions out of order and the
     ratio test is then biased, so it is refused.

Guarantee: the output distribution equals the target's own decoding (under temperature 0,
the same tokens: the argmax of the target's logits, as ``model.generate(do_sample=False)``),
whatever the drafter, its commit rule or the length policy. The drafter only changes speed.

Batches: rows draft and verify together, vectorised (no Python loop over rows). Each row has
its own accepted length; the drafter canvas is column-aligned (prompt left-padded), each row
denoises its own small blocks after its own prefix; the ar-target decoder crops the target's
cache to the shortest row's accepted prefix and the other rows feed their extra accepted
tokens again in the next verification forward (:func:`dloom.ar.chains.chain_layout`). A finished row (EOS or ``max_new_tokens``) stays in the batch
with nothing to do (its slots are padding) until every row is finished.

Drafter KV cache (``drafter_cache``, a registered cache policy of
:func:`dloom.ar.decoder.drafter_cache_modes`, run by the engine's
:class:`~dloom.model.runner.BlockForward`): ``"none"`` recomputes the whole canvas at every
drafter forward; ``"prefix"`` (settled columns, :meth:`~dloom.model.runner.BlockForward.settle`) keeps the keys and values of the columns every row has
accepted (prompt plus the shortest accepted prefix) across steps *and* rounds: each drafter
forward recomputes only the columns after them, and the round's first forward also extends
the kept prefix with the newly accepted columns (computed in that forward, with those tokens
in place). For a bidirectional drafter the kept keys are stale (computed when later columns
held other tokens): drafts differ slightly from uncached ones, the output does not (the
target decides every token).

Host synchronisation: none of FailFast's own; the drafter's checks (NaN logits, an idle commit
rule) ride on the decoder's one synchronisation per drafter step (is any row still drafting,
the layout's width), plus one per round (the new cache length); never per token or per row.
A speculating drafter adds its own speculative step's (laying out its drafts), as in the
diffusion decoder.
"""

from dloom import Claim, Parameter, StrategyRegistration, hookimpl

from .decoder import FailFastDecoder, build_failfast_decoder
from .plugin import FailFast
from .policy import proposal_length, prune_chains
from .settings import (
    DRAFTINGS,
    POLICIES,
    VERIFICATIONS,
    FailFastSettings,
    check_shared_tokenizer,
)
from .verification import verify_ratio

__all__ = [
    "POLICIES", "VERIFICATIONS", "FailFast", "FailFastDecoder", "FailFastSettings",
    "build_failfast_decoder", "check_shared_tokenizer", "dloom_register_strategies",
    "proposal_length", "prune_chains", "verify_ratio",
]

DEFAULTS = FailFastSettings()


@hookimpl
def dloom_register_strategies(register) -> None:
    register(
        StrategyRegistration(
            name="failfast",
            plugin_class=FailFast,
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
                          "the drafter's dLLM decoder composition: a commit rule (threshold, quota, "
                          "factor, frechet) or a speculating one (spiffy+threshold)"),
                Parameter("drafter_tau", DEFAULTS.drafter_tau, float,
                          "tau of the drafter's commit rule, when it has one (threshold)",
                          low=0.0, high=1.0, low_open=True, high_open=True),
                Parameter("drafter_params", DEFAULTS.drafter_params, str,
                          "more drafter parameters, NAME=VALUE[,NAME=VALUE] as --param names them "
                          "(e.g. spiffy.budget=4,spiffy.graph=graph.json)"),
                Parameter("small_block", DEFAULTS.small_block, int,
                          "draft positions denoised together, left to right (1: strictly in order)", low=1),
                Parameter("verification", DEFAULTS.verification, str,
                          "match (sample the target, accept while equal: exact for any drafter) or "
                          "ratio (min(1, p/q) rejection sampling: needs small_block=1)",
                          choices=VERIFICATIONS),
                Parameter("drafting", DEFAULTS.drafting, str,
                          "always, or auto: draft only while it pays under the measured drafter and "
                          "target forward costs (else the target decodes alone)", choices=DRAFTINGS),
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
                    "runs with an AR target (the ar-target decoder, --target/--drafter), not "
                    "inside a diffusion decoder; every temperature"
                ),
            ),
        )
    )
