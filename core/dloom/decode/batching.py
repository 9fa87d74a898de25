"""Batch sizes that fit a memory budget.

A decoding forward holds, per sequence position, the logits and the kernel's float64
probabilities over the vocabulary (``V`` values, about ``BYTES_PER_VOCAB_ENTRY`` bytes each
with the softmax and the Gumbel noise of sampling), one layer's activations (about
``BYTES_PER_HIDDEN_UNIT`` bytes per hidden unit) and one layer's attention scores
(``BYTES_PER_ATTENTION_SCORE`` bytes per head and key position). :func:`plan_batch_size` caps the
requested batch so that ``batch * sequence_length`` tokens fit ``max_batch_tokens``, given
directly or derived from a memory budget (default :data:`DEFAULT_MEMORY_BUDGET` bytes). The
estimate errs high; it bounds the batch, it does not predict the peak exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dloom.decode.prompts import vocabulary_size
from dloom.errors import ConfigurationError

DEFAULT_MEMORY_BUDGET = 2 * 1024**3
BYTES_PER_VOCAB_ENTRY = 24
BYTES_PER_HIDDEN_UNIT = 128
BYTES_PER_ATTENTION_SCORE = 8


@dataclass(frozen=True)
class BatchPlan:
    """The batch size chosen and why.

    :ivar size: prompts per forward batch (>= 1).
    :ivar requested: the batch size asked for.
    :ivar max_batch_tokens: the token cap it was fitted to.
    :ivar bytes_per_token: the estimate behind the cap (``None`` when the cap was given).
    """

    size: int
    requested: int
    max_batch_tokens: int
    bytes_per_token: int | None

    def note(self, sequence_length: int) -> str | None:
        """One line for the user when the batch was reduced, else ``None``."""
        if self.size >= self.requested:
            return None
        why = (
            f"--max-batch-tokens {self.max_batch_tokens}"
            if self.bytes_per_token is None
            else f"a memory budget of {self.max_batch_tokens * self.bytes_per_token / 1024**3:.1f} GiB "
            f"(about {self.bytes_per_token / 1024:.0f} KiB per token; set --max-batch-tokens to change)"
        )
        return (
            f"batch size {self.requested} -> {self.size}: {self.size} x {sequence_length} tokens "
            f"fit {why}"
        )


def bytes_per_token(model: Any, sequence_length: int) -> int:
    """Estimated peak bytes one position of a ``sequence_length`` sequence costs in a
    forward and a kernel step."""
    config = getattr(model.model, "config", None)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    vocab = vocabulary_size(model) or 0
    return max(
        1,
        vocab * BYTES_PER_VOCAB_ENTRY + hidden * BYTES_PER_HIDDEN_UNIT
        + heads * sequence_length * BYTES_PER_ATTENTION_SCORE,
    )


def plan_batch_size(
    model: Any,
    requested: int,
    sequence_length: int,
    max_batch_tokens: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> BatchPlan:
    """The largest batch ``<= requested`` whose ``batch * sequence_length`` tokens fit the cap.

    :param model: a :class:`dloom.ModelAdapter`.
    :param sequence_length: the longest prompt plus the generated length.
    :param max_batch_tokens: the cap; ``None`` derives it from ``memory_budget``.
    :raises ConfigurationError: for a cap below one sequence or a batch size below 1.
    """
    if requested < 1:
        raise ConfigurationError(f"batch size is {requested}; allowed: >= 1")
    per_token = None
    if max_batch_tokens is None:
        per_token = bytes_per_token(model, sequence_length)
        max_batch_tokens = max(sequence_length, memory_budget // per_token)
    if max_batch_tokens < sequence_length:
        raise ConfigurationError(
            f"--max-batch-tokens {max_batch_tokens} is below one sequence of {sequence_length} "
            f"tokens; allowed: >= {sequence_length}"
        )
    size = max(1, min(requested, max_batch_tokens // sequence_length))
    return BatchPlan(size, requested, max_batch_tokens, per_token)
