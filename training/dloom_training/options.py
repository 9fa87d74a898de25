"""A dLLM run's row options (:func:`~dloom_training.losses.dllm_loss`'s): their defaults, how a
resumed run's record and the options given on resuming combine, and their checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .edit_rows import EDIT_RATE, EDIT_TAUS
from .losses import DECODER_TAUS

__all__ = ["RowOptions", "check_parallel_options"]


@dataclass(frozen=True)
class RowOptions:
    """How a dLLM's training rows are drawn and scored (:func:`~dloom_training.losses.dllm_loss`'s
    options of the same names); a causal model's run records them but does not read them.

    The fields are in the order a run's record (``progress.json``, ``eval.json``) lists them.
    """

    pad_weight: float = 1.0
    t_max: float = 1.0
    masks: str = "uniform"
    prefix_share: float = 0.0
    causal_share: float = 0.0
    loss_mean: str = "token"
    decoder_share: float = 0.0
    decoder_fill: str = "answer"
    decoder_rounds: int = 1
    decoder_taus: tuple[float, ...] = DECODER_TAUS
    first_forward_share: float = 0.0
    own_earlier_share: float = 0.0
    label_smoothing: float = 0.0
    edit_share: float = 0.0
    edit_draft_share: float = 0.0
    edit_taus: tuple[float, ...] = EDIT_TAUS
    edit_rate: float = EDIT_RATE

    @classmethod
    def new(cls, given: Mapping[str, Any]) -> RowOptions:
        """A new run's options: those ``given`` (``None`` or absent: the default)."""
        return cls(**_present(given))

    @classmethod
    def continued(cls, run: Mapping[str, Any], given: Mapping[str, Any]) -> RowOptions:
        """An unfinished run's options: its record's (a default for an option the record predates),
        replaced by those ``given`` but for ``pad_weight`` and ``t_max``, which stay the run's."""
        recorded = {f.name: run[f.name] for f in dataclasses.fields(cls) if f.name in run}
        fixed = {"pad_weight": run["pad_weight"], "t_max": run["t_max"]}
        options = {**recorded, **_present(given), **fixed}
        for key, default in (("decoder_taus", DECODER_TAUS), ("edit_taus", EDIT_TAUS)):
            options[key] = tuple(options.get(key, default))
        return cls(**options)

    def record(self) -> dict[str, Any]:
        """The options as a run's record lists them (thresholds as a list)."""
        return {**dataclasses.asdict(self), "decoder_taus": list(self.decoder_taus), "edit_taus": list(self.edit_taus)}

    def check(self, name: str) -> None:
        """Check the options of run ``name`` before any work.

        :raises ValueError: naming the bad value and what is allowed: a prefix or decoder share
            without block masks, prefix and decoder shares above 1 together, a decoder fill or
            more than one decoder round without decoder rows, fewer than one round,
            :func:`check_parallel_options`'s and :meth:`check_edits`'s.
        """
        for option, share in (("prefix_share", self.prefix_share), ("decoder_share", self.decoder_share),
                              ("edit_share", self.edit_share)):
            if share and self.masks != "block":
                raise ValueError(f"{name}: {option} {share} needs block masks, the run's are {self.masks!r}")
        if self.prefix_share + self.decoder_share > 1:
            raise ValueError(f"{name}: prefix_share {self.prefix_share} and decoder_share {self.decoder_share} "
                             "are shares of the same rows: their sum must be at most 1")
        if self.prefix_share + self.decoder_share + self.edit_share > 1:
            raise ValueError(f"{name}: prefix_share {self.prefix_share}, decoder_share {self.decoder_share} and "
                             f"edit_share {self.edit_share} are shares of the same rows: their sum must be at most 1")
        if self.decoder_fill != "answer" and not self.decoder_share:
            raise ValueError(f"{name}: decoder_fill {self.decoder_fill!r} fills the decoder rows: "
                             "it needs a decoder_share")
        if self.decoder_rounds < 1 or (self.decoder_rounds > 1 and not self.decoder_share):
            raise ValueError(f"{name}: decoder_rounds {self.decoder_rounds} is the number of forwards that reveal "
                             "a decoder row's positions: it must be at least 1, and above 1 it needs a decoder_share")
        check_parallel_options(name, self.decoder_share, self.decoder_fill, self.decoder_taus,
                               self.first_forward_share, self.own_earlier_share, self.label_smoothing)
        self.check_edits(name)

    def check_edits(self, name: str) -> None:
        """Check the editing rows' options (:func:`~dloom_training.losses.dllm_loss`'s ``edit_*``).

        :raises ValueError: naming the bad value and what is allowed: a share outside ``[0, 1]``,
            a draft share without edit rows, a draft threshold outside ``(0, 1)``, a noise rate
            outside ``(0, 1]``.
        """
        for option, share in (("edit_share", self.edit_share), ("edit_draft_share", self.edit_draft_share)):
            if not 0 <= share <= 1:
                raise ValueError(f"{name}: {option} {share} is a share of rows: it must be in [0, 1]")
        if self.edit_draft_share and not self.edit_share:
            raise ValueError(f"{name}: edit_draft_share {self.edit_draft_share} is a share of the edit rows: "
                             "it needs an edit_share")
        if not self.edit_taus or any(not 0 < tau < 1 for tau in self.edit_taus):
            raise ValueError(f"{name}: edit_taus {list(self.edit_taus)} are thresholds: each must be in (0, 1)")
        if not 0 < self.edit_rate <= 1:
            raise ValueError(f"{name}: edit_rate {self.edit_rate} is the largest share of a row's filled "
                             "positions replaced: it must be in (0, 1]")


def _present(given: Mapping[str, Any]) -> dict[str, Any]:
    """The ``given`` options that are set (not ``None``), thresholds as a tuple."""
    present = {key: value for key, value in given.items() if value is not None}
    for key in ("decoder_taus", "edit_taus"):
        if key in present:
            present[key] = tuple(present[key])
    return present


def check_parallel_options(
    name: str, decoder_share: float, decoder_fill: str, decoder_taus: Sequence[float], first_forward_share: float,
    own_earlier_share: float, label_smoothing: float,
) -> None:
    """Check the parallel-decoding options of a run (:func:`dllm_loss`'s) before any work.

    :raises ValueError: naming the bad value and what is allowed: a threshold outside
        ``(0, 1)``, a share or ``label_smoothing`` outside ``[0, 1]`` (``label_smoothing``
        below 1), ``first_forward_share`` without decoder rows, ``own_earlier_share`` without
        the ``"threshold"`` fill.
    """
    bad = [tau for tau in decoder_taus if not 0 < tau < 1]
    if not decoder_taus or bad:
        raise ValueError(f"{name}: decoder_taus {list(decoder_taus)} are thresholds: each must be in (0, 1)")
    for option, share in (("first_forward_share", first_forward_share), ("own_earlier_share", own_earlier_share)):
        if not 0 <= share <= 1:
            raise ValueError(f"{name}: {option} {share} is a share of the decoder rows: it must be in [0, 1]")
    if first_forward_share and not decoder_share:
        raise ValueError(f"{name}: first_forward_share {first_forward_share} is a share of the decoder rows: "
                         "it needs a decoder_share")
    if own_earlier_share and decoder_fill != "threshold":
        raise ValueError(f"{name}: own_earlier_share {own_earlier_share} decodes a row's earlier blocks with the "
                         f"threshold rule: it needs decoder_fill 'threshold', got {decoder_fill!r}")
    if not 0 <= label_smoothing < 1:
        raise ValueError(f"{name}: label_smoothing {label_smoothing} must be in [0, 1)")
