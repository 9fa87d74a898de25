"""Greedy token identity: does a strategy produce the reference's tokens, prompt by prompt?

Under ``T == 0`` a lossless strategy must produce the same tokens as its reference, bit for
bit (``docs/concepts.md``, "Lossless"). Both decode the same prompts in the same batches with the same settings;
outputs (tokens up to and including the first EOS) are compared, and the first differing
prompt and position are reported. Run it in float64: in lower precision two exact strategies
can part ways on a near-tie, which is rounding, not a broken strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dloom.check.resolve import Resolved
from dloom.decode.decoder import DiffusionDecoder
from dloom.model.adapter import ModelAdapter


@dataclass(frozen=True)
class GreedyComparison:
    """The outcome of :func:`compare_greedy`.

    :ivar prompts: prompts compared.
    :ivar identical: prompts with identical outputs.
    :ivar first_difference: ``None``, or the first differing prompt: ``{"prompt": index,
        "position": first differing output position, "strategy_tokens": [...],
        "against_tokens": [...]}`` (a position past the shorter output means one output is
        a prefix of the other).
    :ivar model: the model's name; :ivar dtype: its dtype.
    :ivar settings: ``gen_length``, ``block_length``, ``steps``.
    """

    prompts: int
    identical: int
    first_difference: dict[str, Any] | None
    model: str
    dtype: str
    settings: dict[str, Any]

    @property
    def agreement(self) -> float:
        return self.identical / self.prompts if self.prompts else 1.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "agreement": self.agreement}


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(
    decode: Callable[[list[Any]], Sequence[Sequence[int]]],
    reference: Callable[[list[Any]], Sequence[Sequence[int]]],
    prompts: Sequence[Any],
    batch_size: int = 32,
) -> tuple[int, dict[str, Any] | None]:
    """Run ``decode`` and ``reference`` (a batch of prompts to one token list each) on the
    same batches of ``prompts``; return how many outputs are identical and the first
    difference (as :attr:`GreedyComparison.first_difference`)."""
    identical, first = 0, None
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start : start + batch_size])
        for offset, (x, y) in enumerate(zip(decode(chunk), reference(chunk))):
            position = _first_difference(x, y)
            if position is None:
                identical += 1
            elif first is None:
                first = {
                    "prompt": start + offset, "position": position,
                    "strategy_tokens": list(x), "against_tokens": list(y),
                }
    return identical, first


def compare_greedy(
    strategy: Resolved,
    against: Resolved,
    model: ModelAdapter,
    prompts: Sequence[Any],
    *,
    gen_length: int | None = None,
    block_length: int | None = None,
    steps: int | None = None,
    batch_size: int = 32,
) -> GreedyComparison:
    """Decode ``prompts`` greedily with ``strategy`` and ``against``; compare the outputs.

    :param prompts: texts (the model needs a tokenizer) or token-id lists.
    """
    settings: dict[str, Any] = dict(gen_length=gen_length, block_length=block_length, steps=steps, temperature=0.0)
    # the reference decodes on the strategy's kernel, where both run (a fill rule runs on
    # every kernel, and on the revisable one decodes as on the absorbing one)
    ours = DiffusionDecoder(strategy.on(model), strategy.spec, params=strategy.params, **settings)
    theirs = DiffusionDecoder(strategy.on(model), against.spec, params=against.params, **settings)
    identical, first = compare_outputs(
        lambda chunk: ours.generate(chunk).token_lists,
        lambda chunk: theirs.generate(chunk).token_lists,
        prompts, batch_size,
    )
    return GreedyComparison(
        prompts=len(prompts), identical=identical, first_difference=first, model=model.name,
        dtype=str(model.dtype).removeprefix("torch."),
        settings={k: getattr(ours, k) for k in ("gen_length", "block_length", "steps")},
    )
