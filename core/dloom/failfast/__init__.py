"""FailFast: a dLLM drafts for an autoregressive target, losslessly (arXiv 2512.20573;
``docs/strategies/failfast.md``).

Each round, per row:

1. **Draft.** The drafter (a dLLM sharing the target's tokenizer) sees one canvas per row:
   the prompt, the row's accepted tokens, then masks up to ``max_new_tokens``. It denoises
   the masks after the accepted prefix in *small blocks* (default 8 positions), left to
   right, each step one forward and one commit of its commit rule (any dloom strategy with
   ``dloom_select_commit``: quota, threshold, factor, frechet), through the kernel pieces
   :func:`dloom.kernel.propose`, :func:`dloom.hooks.select_commit` and
   :func:`dloom.kernel.apply_commit`. Each committed token's confidence (its probability
   under the drafter's softmax) is recorded. The length policy decides when to stop:

   * ``failfast`` (fail fast, win big): start with ``L = initial_length``. Once the first
     ``L`` draft tokens are committed: if any of their confidences is below ``tau``, stop
     and propose those ``L`` tokens; else if ``L >= n_max``, stop; else ``L += n`` and keep
     denoising.
   * ``naive``: propose the first ``naive_length`` tokens.

   Both never propose past ``max_new_tokens`` nor past the first drafted EOS (the EOS itself
   is proposed).

2. **Verify.** One target forward over the row's draft (plus the accepted tokens the
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
denoises its own small blocks after its own prefix; the target's cache is cropped to the
shortest row's accepted prefix and the other rows feed their extra accepted tokens again in
the next verification forward. A finished row (EOS or ``max_new_tokens``) stays in the batch
with nothing to do (its slots are padding) until every row is finished.

Drafter KV cache (``drafter_cache``): ``"none"`` recomputes the whole canvas at every
drafter forward; ``"prefix"`` keeps the keys and values of the columns every row has
accepted (prompt plus the shortest accepted prefix) across steps *and* rounds: each drafter
forward recomputes only the columns after them, and the round's first forward also extends
the kept prefix with the newly accepted columns (computed in that forward, with those tokens
in place). For a bidirectional drafter the kept keys are stale (computed when later columns
held other tokens): drafts differ slightly from uncached ones, the output does not (the
target decides every token).

Host synchronisation: once per drafter step (is any row still drafting) and once per round
(the verification layout's width, the new cache length); never per token or per row.
"""

from dloom.failfast.decoder import FailFastDecoder, build_failfast_decoder
from dloom.failfast.policy import proposal_length
from dloom.failfast.result import FailFastResult
from dloom.failfast.settings import (
    DEFAULT_MAX_NEW_TOKENS,
    DRAFTER_CACHE_MODES,
    POLICIES,
    VERIFICATIONS,
    FailFastSettings,
    check_shared_tokenizer,
)
from dloom.failfast.verification import sample_target, verify_match, verify_ratio

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS", "DRAFTER_CACHE_MODES", "POLICIES", "VERIFICATIONS",
    "FailFastDecoder", "FailFastResult", "FailFastSettings", "build_failfast_decoder",
    "check_shared_tokenizer", "proposal_length", "sample_target",
    "verify_match", "verify_ratio",
]
