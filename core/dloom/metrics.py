"""Decoding metrics (one definition everywhere) and the model-forward clock.

- NFE: forward passes of the model being accelerated, per row while that row is decoding.
- TPF: generated tokens per forward (aggregate: total generated / total row-forwards).
- TPS: generated tokens per wall-clock second.
- generated tokens: the tokens up to and including the first EOS, never prompt or padding.

Timings are host wall-clock; on an asynchronous device (CUDA) a hook's time is the time to
launch its work unless the decoder was built with ``sync_timing=True``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class ForwardClock:
    """The wall time of a decoder's model forwards, added up (what a result reports as
    ``hook_seconds["forward"]``). The decoder resets it when a
    :class:`dloom.decode.session.DecodeSession` starts, and reads it back.

    :param synchronize: called before and after each timed call (``torch.cuda.synchronize``
        for honest GPU timing), or ``None``.
    :ivar seconds: forward seconds since the last :meth:`reset`.
    """

    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self.seconds = 0.0
        self._synchronize = synchronize

    def reset(self) -> None:
        self.seconds = 0.0

    def timed(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` (model forwards), its time added to :attr:`seconds`."""
        if self._synchronize:
            self._synchronize()
        start = time.perf_counter()
        out = call(*args)
        if self._synchronize:
            self._synchronize()
        self.seconds += time.perf_counter() - start
        return out


def speculation_summary(verifications: int, accepted_drafts: int, exact: bool) -> dict[str, Any]:
    """The acceptance figures every speculative result reports (JSON-ready)."""
    return {
        "verifications": verifications,
        "accepted_drafts": accepted_drafts,
        "accepted_per_verification": accepted_drafts / verifications if verifications else 0.0,
        "guarantee": "lossless" if exact else "near-lossless",
    }


@dataclass
class GenerationResult:
    """What :meth:`dloom.DiffusionDecoder.generate` returns for a batch.

    :ivar sequences: ``(B, L)`` long, prompt (left-padded) and generated region as decoded;
        positions a finished row never needed stay masked.
    :ivar generated: ``(B, G)`` long, the generated region alone (``G = gen_length``; with
        a model's ``block_alignment="absolute"`` ``G = gen_length + block_length - 1``: each
        row's last block is completed, and columns past it hold padding).
    :ivar generated_lengths: ``(B,)`` long, tokens up to and including the first EOS (all of
        ``G`` when no EOS was generated).
    :ivar nfe: ``(B,)`` long, forwards in which each row still had masked positions to decode
        (rows advance through blocks independently and leave the batch when finished, so
        this is every forward the row took part in, the same as decoding it alone).
    :ivar forwards: the decoder's steps over the whole batch, each one forward of every row
        still decoding (and one host synchronisation).
    :ivar model_calls: model calls those steps made: a step with a cache takes two when some
        rows start a block (a full forward for them, a cached one for the others), and a
        verification one per ``B`` rows of its layout
        (:func:`dloom.decode.speculation.evaluate_in_parts`; still one step and one NFE per row).
    :ivar row_forwards: rows in those calls, summed (batch rows, not verification layout
        rows); ``1 - sum(nfe) / row_forwards`` is the share of row-forwards spent on rows
        that took no step.
    :ivar verification_forwards: steps that verified drafts (speculative strategies).
    :ivar verifications: row-verifications: rows still decoding in a verification forward
        of a speculative strategy (0 without speculation).
    :ivar accepted_drafts: drafts those verifications accepted, over all rows; each saved
        one forward.
    :ivar layout_exact: whether every verification layout gave exact draft distributions
        (``None`` for a strategy without a ``draft`` hook; ``True`` also when a speculative
        strategy never needed to verify; ``False``: the run was near-lossless).
    :ivar wall_seconds: wall time of the whole generation.
    :ivar hook_seconds: wall time per hook plus ``"forward"`` for the model.
    :ivar texts: decoded text up to the first EOS, one per row, when a tokenizer is known.
    :ivar config: the settings the generation ran with.
    :ivar edits: ``(B,)`` long, the edits each row took on an editing kernel: writes that
        changed a filled generated position (token-to-token rewrites, remasks, tokens moved by
        a Levenshtein delete or split; :mod:`dloom.decode.edit_ledger`). ``None`` on a kernel
        that does not edit (a fill rule), where no filled token ever changes.
    :ivar drafts: ``(B, G)`` long, each generated position's first filled token (masked where
        none was): the answer the row would have given without its edits (``None`` likewise).
    :ivar draft_texts: ``drafts``' text up to their first EOS, one per row, when a tokenizer
        is known and the kernel edits; :mod:`dloom.evaluation` scores it to tell whether an
        edit fixed a wrong draft.
    """

    sequences: torch.Tensor
    generated: torch.Tensor
    generated_lengths: torch.Tensor
    nfe: torch.Tensor
    forwards: int
    wall_seconds: float
    hook_seconds: dict[str, float]
    config: dict[str, Any]
    texts: list[str] | None = None
    token_lists: list[list[int]] = field(default_factory=list)
    verifications: int = 0
    accepted_drafts: int = 0
    layout_exact: bool | None = None
    row_forwards: int = 0
    model_calls: int = 0
    verification_forwards: int = 0
    edits: torch.Tensor | None = None
    drafts: torch.Tensor | None = None
    draft_texts: list[str] | None = None

    @property
    def speculation(self) -> dict[str, Any] | None:
        """Acceptance figures of a speculative run (``None`` without speculation):
        ``accepted_per_verification`` is accepted drafts per row-verification, and
        ``guarantee`` is ``"lossless"`` or ``"near-lossless"`` (a packed layout whose
        context depends on the active block)."""
        if self.layout_exact is None:
            return None
        return speculation_summary(self.verifications, self.accepted_drafts, self.layout_exact)

    @property
    def total_generated(self) -> int:
        return int(self.generated_lengths.sum())

    @property
    def tpf(self) -> float:
        """Generated tokens per row-forward, over the whole batch."""
        total_nfe = int(self.nfe.sum())
        return self.total_generated / total_nfe if total_nfe else 0.0

    @property
    def tps(self) -> float:
        """Generated tokens per wall-clock second."""
        return self.total_generated / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def hook_share(self) -> dict[str, float]:
        """Each hook's (and the forward's) share of the wall time, in [0, 1]."""
        if self.wall_seconds <= 0:
            return {name: 0.0 for name in self.hook_seconds}
        return {name: s / self.wall_seconds for name, s in self.hook_seconds.items()}

    def row(self, index: int) -> dict[str, Any]:
        """A JSON-ready summary of one row (``text``, ``tokens``, ``nfe``, ``tpf``, ``tps``,
        and the batch's ``speculation`` figures; on an editing kernel also ``edits`` and
        ``draft_text``)."""
        nfe = int(self.nfe[index])
        length = int(self.generated_lengths[index])
        edited = {} if self.edits is None else {
            "edits": int(self.edits[index]),
            "draft_text": self.draft_texts[index] if self.draft_texts is not None else None,
        }
        return {
            "text": self.texts[index] if self.texts is not None else None,
            "tokens": self.token_lists[index],
            "nfe": nfe,
            "tpf": length / nfe if nfe else 0.0,
            "tps": self.tps,
            "speculation": self.speculation,
            "config": self.config,
            **edited,
        }

    def summary(self) -> dict[str, Any]:
        """A JSON-ready summary of the batch."""
        return {
            "n": int(self.nfe.shape[0]),
            "nfe_mean": float(self.nfe.double().mean()),
            "forwards": self.forwards,
            "generated_tokens": self.total_generated,
            "tpf": self.tpf,
            "tps": self.tps,
            "wall_seconds": self.wall_seconds,
            "hook_seconds": dict(self.hook_seconds),
            "hook_share": self.hook_share,
            "speculation": self.speculation,
            "config": self.config,
        }
