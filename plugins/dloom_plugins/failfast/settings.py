"""FailFast's settings, their checks, and the shared-tokenizer check."""

from __future__ import annotations

from dataclasses import dataclass

from dloom.sdk import ConfigurationError, ModelAdapter, ModelError

POLICIES = ("failfast", "naive")
DRAFTINGS = ("always", "auto")
VERIFICATIONS = ("match", "ratio")


# --- the strategy's settings ---------------------------------------------------------------


@dataclass(frozen=True)
class FailFastSettings:
    """The ``failfast`` strategy's parameters (the object its registration builds).

    :ivar tau: fail fast when a committed confidence among the first ``L`` is below it.
    :ivar n: win big: ``L`` grows by ``n`` when all first ``L`` confidences are ``>= tau``.
    :ivar n_max: the most draft tokens of the ``failfast`` policy in one round.
    :ivar initial_length: ``L`` at the start of a round (``<= n_max``).
    :ivar policy: ``"failfast"`` or ``"naive"`` (a fixed ``naive_length``).
    :ivar naive_length: draft length of the ``naive`` policy.
    :ivar drafter_strategy: the drafter's decoder composition: any composition a
        :class:`dloom.DiffusionDecoder` takes, a commit rule (``threshold``, ``frechet``) or a
        speculating one (``spiffy+threshold``: Spiffy over that rule, lossless against it).
    :ivar drafter_tau: ``tau`` of the drafter's commit rule when it declares one (threshold).
    :ivar drafter_params: more parameters of the drafter composition, as comma-separated
        ``NAME=VALUE`` items named as ``--param`` names them (``"spiffy.budget=4,spiffy.graph=g.json"``).
    :ivar small_block: positions denoised together, left to right (1: strictly left to right).
    :ivar verification: ``"match"`` (exact for any drafter) or ``"ratio"`` (needs
        ``small_block == 1``, checked when the decoder is built).
    :ivar drafting: ``"always"``, or ``"auto"``: draft only while it pays under the
        measured drafter and target forward costs (:mod:`.payoff`), else decode with the
        target alone.
    :raises ConfigurationError: ``initial_length > n_max``, or a value outside its range.
    """

    tau: float = 0.45
    n: int = 10
    n_max: int = 60
    initial_length: int = 10
    policy: str = "failfast"
    naive_length: int = 8
    drafter_strategy: str = "threshold"
    drafter_tau: float = 0.05
    drafter_params: str = ""
    small_block: int = 8
    verification: str = "match"
    drafting: str = "always"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigurationError(f"failfast policy is {self.policy!r}; allowed: {', '.join(POLICIES)}")
        if self.drafting not in DRAFTINGS:
            raise ConfigurationError(f"failfast drafting is {self.drafting!r}; allowed: {', '.join(DRAFTINGS)}")
        if self.verification not in VERIFICATIONS:
            raise ConfigurationError(
                f"failfast verification is {self.verification!r}; allowed: {', '.join(VERIFICATIONS)}"
            )
        if not 0.0 <= self.tau <= 1.0:
            raise ConfigurationError(f"failfast tau is {self.tau!r}; allowed: [0, 1]")
        for name in ("n", "n_max", "initial_length", "naive_length", "small_block"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigurationError(f"failfast {name} is {value!r}; allowed: [1, inf)")
        if self.initial_length > self.n_max:
            raise ConfigurationError(
                f"failfast initial_length {self.initial_length} exceeds n_max {self.n_max}; "
                f"allowed: 1 <= initial_length <= n_max"
            )


# --- shared tokenizer ------------------------------------------------------------------------


def check_shared_tokenizer(target: ModelAdapter, drafter: ModelAdapter) -> None:
    """Raise unless the drafter's token ids mean what the target's do.

    With tokenizers on both sides: the vocabularies (``get_vocab()``) must be equal, except
    that the drafter may have one token the target lacks, its mask token (a dLLM's added
    ``[MASK]``; never proposed). Without tokenizers on either side: the models' vocabulary
    sizes (``config.vocab_size``) must be equal.

    :raises ModelError: naming both models and the first differing token (by id), or the
        sizes; or when only one model has a tokenizer.
    """
    names = f"drafter {drafter.name!r} and target {target.name!r}"
    if target.tokenizer is None and drafter.tokenizer is None:
        sizes = [getattr(getattr(m.model, "config", None), "vocab_size", None) for m in (drafter, target)]
        if sizes[0] != sizes[1]:
            raise ModelError(f"{names} do not share a vocabulary: vocab_size {sizes[0]} vs {sizes[1]}")
        return
    if target.tokenizer is None or drafter.tokenizer is None:
        missing = target if target.tokenizer is None else drafter
        raise ModelError(
            f"{names}: model {missing.name!r} has no tokenizer, so dloom cannot check that they "
            "share one; give both a tokenizer (or neither, with equal vocab_size)"
        )
    draft_vocab = dict(drafter.tokenizer.get_vocab())
    target_vocab = dict(target.tokenizer.get_vocab())
    mask = drafter.mask_token_id
    extra = [t for t, i in draft_vocab.items() if i == mask and t not in target_vocab]
    for token in extra:
        del draft_vocab[token]
    if draft_vocab == target_vocab:
        return
    by_id_d = {i: t for t, i in draft_vocab.items()}
    by_id_t = {i: t for t, i in target_vocab.items()}
    for i in sorted(set(by_id_d) | set(by_id_t)):
        if by_id_d.get(i) != by_id_t.get(i):
            raise ModelError(
                f"{names} do not share a tokenizer: token id {i} is {by_id_d.get(i)!r} in the "
                f"drafter and {by_id_t.get(i)!r} in the target; FailFast needs one vocabulary"
            )
