"""Pieces of the transition kernel ``K`` (``docs/concepts.md``, "The decode loop").

One step on the active block: candidates and confidences from the block's logits
(:func:`propose`), a commit rule picks positions (the ``dloom_select_commit`` hook), and
those positions take their candidates (:func:`apply_commit`); :class:`KernelStep` takes that
step for every row of a batch.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import NamedTuple

import torch

from dloom.hooks import calls as hooks
from dloom.types import BlockSchedule

REMASKING = ("low_confidence", "random", "margin", "entropy")

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (wrapping arithmetic): a bijection of 64-bit
    patterns whose outputs pass standard tests of randomness for consecutive inputs."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


class RowStreams:
    """Counter-based random numbers, one independent stream per prompt.

    Draw ``n`` of stream ``s`` under ``seed`` is a pure function of ``(seed, s, n, tag,
    element)``: the SplitMix64 finaliser of a key combining them, turned into a float64 in
    ``(0, 1)`` from its top 53 bits. So a prompt's random numbers depend only on the seed,
    its index in the request (its stream) and how many kernel steps it has taken, never on
    which other prompts share its batch or in which order rows step; and no Python loop over
    rows is needed. A row's counter advances only when it takes a kernel step
    (:meth:`advance`).

    :param seed: the decoder's seed; ``None`` draws one at random (nondeterministic).
    :param streams: ``(B,)`` long, each row's stream (its prompt's index in the request).

    :ivar draws: ``(B,)`` long, kernel steps each row has taken.
    :ivar offset: ``(B,)`` long or ``None``: where each row's own numbering of dimension 1
        starts (FailFast drafts over a window whose start depends on the batch; the offset
        keys every draw to the row's own position).
    """

    def __init__(self, seed: int | None, streams: torch.Tensor) -> None:
        self.seed = secrets.randbits(62) if seed is None else int(seed)
        self.streams = streams
        self.draws = torch.zeros_like(streams)
        self.offset: torch.Tensor | None = None

    def uniform(self, shape: tuple[int, ...], tag: int) -> torch.Tensor:
        """Float64 uniforms in ``(0, 1)`` of ``shape`` ``(B, ...)``, row ``b`` from its stream's
        current draw; ``tag`` tells apart the arrays one step draws (Gumbel noise, random
        confidences)."""
        key = mix64(torch.full_like(self.streams, _signed(self.seed * 4 + tag)) + self.streams * _GOLDEN)
        key = mix64(key + self.draws * _MIX1)
        count = 1
        for size in shape[1:]:
            count *= size
        element = torch.arange(1, count + 1, device=key.device).view(1, *shape[1:])
        if self.offset is not None and len(shape) > 1:
            # entry i of dimension 1 is the row's position offset + i (its own numbering)
            inner = count // shape[1]
            element = element + (self.offset * inner).view(-1, *([1] * (len(shape) - 1)))
        bits = mix64(key.view(-1, *([1] * (len(shape) - 1))) + element * _GOLDEN)
        return (_shift_right(bits, 11).to(torch.float64) + 0.5) * 2.0**-53

    def advance(self, stepped: torch.Tensor) -> None:
        """Count a kernel step for the rows ``stepped`` (``(B,)`` bool)."""
        self.draws = self.draws + stepped.long()

    def select(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (``(B',)`` long), in that order."""
        self.streams, self.draws = self.streams[index], self.draws[index]
        if self.offset is not None:
            self.offset = self.offset[index]

    def join(self, streams: torch.Tensor) -> None:
        """Append rows drawing from ``streams`` (``(J,)`` long), each at its first draw."""
        if self.offset is not None:
            raise ValueError("rows cannot join streams keyed to position offsets")
        self.streams = torch.cat([self.streams, streams])
        self.draws = torch.cat([self.draws, torch.zeros_like(streams)])


def uniform_noise(source, shape, tag: int, device) -> torch.Tensor:
    """Float64 uniforms in ``(0, 1)`` of ``shape`` from ``source``: a :class:`RowStreams`
    (row ``b`` from its stream's current draw, ``tag`` telling arrays apart), a
    ``torch.Generator`` or ``None`` (torch's global generator; ``tag`` unused)."""
    if isinstance(source, RowStreams):
        return source.uniform(tuple(shape), tag)
    return torch.rand(shape, dtype=torch.float64, generator=source, device=device)


def gumbel_argmax(
    scores: torch.Tensor, source: torch.Generator | RowStreams | None, tag: int, scale: float = 1.0
) -> torch.Tensor:
    """A sample of ``softmax(scores / scale)`` by Gumbel-max in float64:
    ``argmax(scores - scale * log(-log u))``.

    :param scores: ``(B, ..., V)`` float64 log-weights (``-inf``: impossible).
    :param source: where the uniforms ``u`` come from (:func:`uniform_noise`).
    :param tag: the array's tag in a row's stream.
    :param scale: the temperature (``> 0``) when ``scores`` are untempered logits.
    :return: ``(B, ...)`` long.
    """
    uniform = uniform_noise(source, scores.shape, tag, scores.device)
    return torch.argmax(scores - scale * torch.log(-torch.log(uniform)), dim=-1)


def without_mask(logits: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """A float64 copy of ``logits`` (``(..., V)``) with the mask token's logit at ``-inf``,
    so that no distribution derived from it (softmax, argmax, sample) gives the mask mass."""
    logits64 = logits.to(torch.float64, copy=True)
    logits64[..., mask_token_id] = -torch.inf
    return logits64


def propose(
    logits: torch.Tensor,
    temperature: float,
    remasking: str,
    generator: torch.Generator | RowStreams | None,
    mask_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate token and confidence for every position of the block.

    The mask token is never a candidate: its logit is set to ``-inf`` first (a trained dLLM
    gives it no mass; an untrained one could otherwise "commit" a mask forever).

    Sampling is Gumbel-max in float64 as in LLaDA: LLaDA's
    ``argmax(exp(l) / (-log u) ** T)`` is computed as the equal
    ``argmax(l - T * log(-log u))``, which does not overflow; with ``T == 0`` the candidate is
    the argmax and no random numbers are drawn. Confidences follow LLaDA and Dream: the
    candidate's probability under ``softmax(logits)`` (``low_confidence``), a uniform draw
    (``random``), the top-1 minus top-2 probability (``margin``) or the negative entropy
    (``entropy``).

    Precision: float64 where a guarantee needs it, that is for float64 logits (the
    bit-for-bit reference) and for sampling (float64 Gumbel-max, whose draws the sampling
    proofs check). Greedy ``low_confidence`` and ``random`` on lower-precision logits take
    a float32 pass instead (:func:`greedy_float32`): the same candidates (the argmax does not
    depend on the precision of a softmax) and the candidate's probability as
    ``exp(max - logsumexp)`` within float32 rounding (tested to ``1e-6``), without a
    float64 copy of the ``(B, K, V)`` logits nor a full softmax.

    :param logits: ``(B, K, V)`` logits of the active block, any float dtype.
    :param temperature: ``T >= 0``.
    :param remasking: one of :data:`REMASKING`.
    :param generator: random source for the Gumbel noise and ``random`` remasking: a
        :class:`RowStreams` (the decoder's: one stream per prompt), a ``torch.Generator`` or
        ``None`` (torch's global one).
    :param mask_token_id: the mask token's id.
    :return: ``candidates`` ``(B, K)`` long and ``confidence`` ``(B, K)`` float (float64,
        or float32 from the float32 pass).
    """
    if remasking not in REMASKING:
        raise ValueError(f"remasking is {remasking!r}; allowed: {', '.join(REMASKING)}")
    fast = temperature == 0 and remasking in ("low_confidence", "random")
    if fast and logits.dtype != torch.float64:
        candidates, confidence = greedy_float32(logits, mask_token_id, remasking == "low_confidence")
        if remasking == "random":
            confidence = uniform_noise(generator, candidates.shape, 1, logits.device)
        return candidates, confidence
    logits64 = without_mask(logits, mask_token_id)
    if temperature > 0:
        candidates = gumbel_argmax(logits64, generator, 0, scale=temperature)
    else:
        candidates = torch.argmax(logits64, dim=-1)
    if remasking == "random":
        confidence = uniform_noise(generator, candidates.shape, 1, logits64.device)
        return candidates, confidence
    probs = torch.softmax(logits64, dim=-1)
    if remasking == "low_confidence":
        confidence = torch.gather(probs, -1, candidates.unsqueeze(-1)).squeeze(-1)
    elif remasking == "margin":
        top2 = torch.topk(probs, k=2, dim=-1).values
        confidence = top2[..., 0] - top2[..., 1]
    else:  # entropy
        confidence = torch.sum(probs * torch.log(probs.clamp_min(1e-300)), dim=-1)
    return candidates, confidence


def commit_signals(
    logits: torch.Tensor, candidates: torch.Tensor, block: torch.Tensor, names: tuple[str, ...], mask_token_id: int
) -> dict[str, torch.Tensor]:
    """The signals ``names`` (:data:`dloom.hooks.specs.COMMIT_SIGNALS`) of the block's
    distribution ``softmax(logits)``, mask token left out, in float64: what a commit rule
    declared with :func:`dloom.hooks.specs.reads_signals`. Only those are computed.

    :param logits: ``(B, K, V)`` logits of the active block, any float dtype.
    :param candidates: ``(B, K)`` long, the step's candidates (:func:`propose`).
    :param block: ``(B, K)`` long, the block's current tokens (the mask id where masked).
    :return: ``{name: tensor}``: ``confidence``, ``margin``, ``entropy``,
        ``token_probability`` ``(B, K)``, ``probabilities`` ``(B, K, V)``.
    """
    probs = torch.softmax(without_mask(logits, mask_token_id), dim=-1)
    signals: dict[str, torch.Tensor] = {}
    for name in names:
        if name == "confidence":
            signals[name] = torch.gather(probs, -1, candidates.unsqueeze(-1)).squeeze(-1)
        elif name == "margin":
            top2 = torch.topk(probs, k=2, dim=-1).values
            signals[name] = top2[..., 0] - top2[..., 1]
        elif name == "entropy":
            signals[name] = -torch.sum(probs * torch.log(probs.clamp_min(1e-300)), dim=-1)
        elif name == "token_probability":
            signals[name] = token_probability(probs, block, mask_token_id)
        else:  # probabilities
            signals[name] = probs
    return signals


def token_probability(probs: torch.Tensor, block: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """``(B, K)`` float64, the probability ``probs`` (``(B, K, V)``, a distribution over the
    vocabulary) gives each position's current token in ``block`` (``(B, K)`` long); 0 where
    the position is masked."""
    picked = torch.gather(probs.to(torch.float64), -1, block.unsqueeze(-1)).squeeze(-1)
    return torch.where(block == mask_token_id, 0.0, picked)


def greedy_float32(
    logits: torch.Tensor, mask_token_id: int, confidence: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy candidates and their probabilities in one float32 pass over the logits.

    :param logits: ``(B, K, V)``, any float dtype (upcast to float32: exact from bfloat16
        and float16).
    :param confidence: also compute ``softmax(logits)[candidate]`` as
        ``exp(max - logsumexp)`` (else the second result is the candidate's logit).
    :return: ``candidates`` ``(B, K)`` long (the mask token excluded) and ``(B, K)`` float32.
        NaN anywhere in a position's logits makes its confidence NaN (the decoder's check).
    """
    work = logits.float()  # a copy unless the logits are float32 already
    if work is logits:
        work = work.clone()  # the caller's logits stay as they are
    work[..., mask_token_id] = -torch.inf
    best, candidates = work.max(dim=-1)
    if not confidence:
        return candidates, best
    return candidates, torch.exp(best - torch.logsumexp(work, dim=-1))


def apply_commit(
    block: torch.Tensor, candidates: torch.Tensor, commit: torch.Tensor
) -> torch.Tensor:
    """The block after committing: ``commit`` positions take their candidates.

    :param block: ``(B, K)`` long, current tokens of the active block.
    :param candidates: ``(B, K)`` long.
    :param commit: ``(B, K)`` bool.
    :return: ``(B, K)`` long, a new tensor.
    """
    return torch.where(commit, candidates, block)


def eos_clear(
    block: torch.Tensor, mask_token_id: int, eos_ids: torch.Tensor, generated: torch.Tensor | None = None
) -> torch.Tensor:
    """``(B,)`` bool, blocks holding a generated EOS with nothing masked before it.

    For a row still decoding at the start of its block (earlier blocks are complete and hold
    no EOS), this is exactly "the row has finished" while that block is active.

    :param generated: ``(B, K)`` bool, the block's generated positions; ``None``: all of them.
        A block-causal model whose blocks are aligned at position 0 decodes the prompt's last
        partial block with its first generated positions, and an EOS id among those prompt
        positions (a chat template's end-of-turn) does not end the row.
    """
    clear_before = (block == mask_token_id).long().cumsum(-1) == 0
    eos = torch.isin(block, eos_ids)
    if generated is not None:
        eos = eos & generated
    return (eos & clear_before).any(-1)


def selectable_positions(
    block: torch.Tensor, mask_token_id: int, eos_ids: torch.Tensor, generated: torch.Tensor | None = None
) -> torch.Tensor:
    """``(B, K)`` bool, the positions a kernel step may commit: masked, generated
    (``generated``: as in :func:`eos_clear`; a prompt or an already accepted token that
    happens to be the mask id is never committed over), in unfinished rows."""
    finished = eos_clear(block, mask_token_id, eos_ids, generated)
    selectable = (block == mask_token_id) & ~finished.unsqueeze(1)
    return selectable if generated is None else selectable & generated


class Settlement(NamedTuple):
    """Where each row stands after a step (``B`` rows; :meth:`KernelStep.settle`).

    :ivar ended: ``(B,)`` bool, rows whose output is final within this block (an EOS the
        kernel will not revise, with nothing undecided before it).
    :ivar complete: ``(B,)`` bool, rows whose block is final: the row moves on to its next
        block, or leaves the batch after its last one.
    """

    ended: torch.Tensor
    complete: torch.Tensor


IDLE = 1
"""``KernelStep.idle``: a row with a selectable position committed nothing."""
IDLE_DECODED = 2
"""``KernelStep.idle``: a row committed nothing because its commits all fell on positions
already decoded (not selectable)."""


def idle_problem(rule: str, code: int) -> str:
    """What the commit rule ``rule`` (its plugin's name) did wrong, for an ``idle`` code of
    :class:`KernelStep` (``IDLE`` or ``IDLE_DECODED``)."""
    if code >= IDLE_DECODED:
        return (
            f"commit rule {rule!r} committed positions that were already decoded (not "
            "selectable) and nothing else in a row that had masked positions; commit a subset "
            "of selectable"
        )
    return (
        f"commit rule {rule!r} committed no position in a row that had masked positions; "
        "every step must commit at least one"
    )


class KernelStep:
    """The absorbing transition kernel ``K``: one step on the active block, for every row of
    a batch (:class:`dloom.decode.transition.TransitionKernel`; a committed token is final).

    Propose candidates and confidences (:func:`dloom.decode.kernel.propose`), compute the
    signals the commit rule declared (:func:`commit_signals`), ask the commit rule
    (``dloom_select_commit``) and commit. Counts each row's steps in its current block (the
    quota schedule's ``step_in_block``) and records contract violations on the device, for
    the decoder to check at its next host synchronisation. Rows are in different blocks:
    :meth:`start_block` resets the rows that moved on.

    :param pm: the decoder's plugin manager.
    :param temperature: / :param remasking: as in :func:`propose`.
    :param generator: the random source (:class:`dloom.decode.kernel.RowStreams`, one stream per
        prompt, advanced for the rows that step; or a ``torch.Generator`` or ``None``).
    :param mask_token_id: the mask id.
    :param eos_ids: ``(E,)`` long.
    :param steps_per_block: the block's step budget.
    :param masked_at_start: ``(B,)`` long, masked positions per row at its block's start.
    :param on_proposal: an observer called at every step, before the commit rule, with the
        step's candidates ``(B, K)`` long and confidences ``(B, K)``; it must not modify them
        (the commit hook is given the confidences only). ``None``: nothing is called.

    :ivar signals: the signals the commit rule declared (:func:`dloom.hooks.calls.declared_signals`),
        computed at every step (:func:`commit_signals`); empty for the built-in rules.
    :ivar steps: ``(B,)`` long, kernel steps each row has taken in its current block.
    :ivar generated: ``(B, K)`` bool, the generated positions of each row's active block
        (:func:`eos_clear`; set by :meth:`restrict`), or ``None`` when every position of
        every block is generated.
    :ivar idle: ``()`` long: :data:`IDLE` when some row with a selectable position committed
        nothing, :data:`IDLE_DECODED` when (also) some row committed nothing because the
        rule's commits all fell on positions that were not selectable (already decoded), 0
        otherwise (:func:`idle_problem` words it).
    :ivar non_finite: ``()`` bool, some stepping row's logits held NaN or inf.
    """

    #: the kernel draws random numbers at every temperature (the session then gives it the
    #: prompts' random streams whatever the decoder's temperature)
    samples = False
    #: the commit rule may rewrite filled positions (the revisable kernel with an editing
    #: rule); the session then counts edits and drafts (:mod:`dloom.decode.edit_ledger`)
    edits = False

    def __init__(
        self, pm, temperature, remasking, generator, mask_token_id, eos_ids, steps_per_block,
        masked_at_start, on_proposal: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        self.pm = pm
        self.signals = hooks.declared_signals(pm)
        self.on_proposal = on_proposal
        self.temperature, self.remasking, self.generator = temperature, remasking, generator
        self.mask_token_id, self.eos_ids = mask_token_id, eos_ids
        self.steps_per_block = steps_per_block
        self.masked_at_start = masked_at_start
        self.steps = torch.zeros_like(masked_at_start)
        self.generated: torch.Tensor | None = None  # (B, K) bool (restrict) when a block holds prompt positions
        self.idle = torch.zeros((), dtype=torch.long, device=masked_at_start.device)
        self.non_finite = torch.zeros((), dtype=torch.bool, device=masked_at_start.device)

    def __call__(
        self, block: torch.Tensor, logits: torch.Tensor, advance: torch.Tensor
    ) -> torch.Tensor:
        """The next ``(B, K)`` blocks; rows where ``advance`` (``(B,)`` bool) is ``False``,
        and finished rows, are returned unchanged and take no step."""
        selectable = selectable_positions(block, self.mask_token_id, self.eos_ids, self.generated)
        selectable &= advance.unsqueeze(1)
        candidates, confidence = propose(
            logits, self.temperature, self.remasking, self.generator, self.mask_token_id
        )
        if self.on_proposal is not None:
            self.on_proposal(candidates, confidence)
        schedule = BlockSchedule(self.steps, self.steps_per_block, self.masked_at_start)
        signals = None
        if self.signals:  # only what the rule declared (the default rules declare none)
            signals = commit_signals(logits, candidates, block, self.signals, self.mask_token_id)
        answer = hooks.proposed_commit(self.pm, confidence, selectable, schedule, signals)
        commit = answer & selectable
        stepping = selectable.any(-1)
        empty = stepping & ~commit.any(-1)
        # IDLE_DECODED when a row came out empty because the rule committed only positions
        # that were not selectable (already decoded): the message names that bug instead
        stray = empty & (answer & ~selectable).any(-1)
        self.idle = torch.maximum(self.idle, empty.any().long() + stray.any().long())
        # NaN or inf anywhere in a stepping row's logits reaches its candidates' logits or
        # confidences (a logsumexp, a softmax, an argmax): checked on (B, K), not (B, K, V).
        picked = torch.gather(logits, -1, candidates.unsqueeze(-1)).squeeze(-1)
        finite = torch.isfinite(picked) & torch.isfinite(confidence)
        self.non_finite = self.non_finite | (stepping.unsqueeze(1) & ~finite).any()
        self.steps = self.steps + stepping.long()
        if isinstance(self.generator, RowStreams):
            self.generator.advance(stepping)
        return apply_commit(block, candidates, commit)

    def unchanged_post_steps(self) -> torch.Tensor | None:
        """``(B,)`` bool, rows whose last step began with a block that held no mask and left
        it unchanged (the forward it read is then the one the row's next step would run on
        the same tokens); ``None`` for a kernel that takes no such step (this one: a block
        is complete once it holds no mask)."""
        return None

    def restrict(self, generated: torch.Tensor | None) -> None:
        """The generated positions of each row's active block (``(B, K)`` bool, ``None``: all);
        a step commits no other position, and an EOS elsewhere ends no row (:func:`eos_clear`)."""
        self.generated = generated

    def pending(self, block: torch.Tensor) -> torch.Tensor:
        """``(B,)`` bool, rows whose block ``(B, K)`` still has a position to commit."""
        return selectable_positions(block, self.mask_token_id, self.eos_ids, self.generated).any(-1)

    def settle(self, block: torch.Tensor) -> Settlement:
        """Where each row stands with its block ``(B, K)`` after a step (a committed token is
        final): ended when it holds a generated EOS with nothing masked before it, complete
        when it holds no mask."""
        ended = eos_clear(block, self.mask_token_id, self.eos_ids, self.generated)
        return Settlement(ended, ~(block == self.mask_token_id).any(-1))

    def start_block(self, moving: torch.Tensor, block: torch.Tensor) -> None:
        """Rows ``moving`` (``(B,)`` bool) start the block ``block`` (``(B, K)``, their new one)."""
        self.steps = torch.where(moving, 0, self.steps)
        masked = (block == self.mask_token_id).sum(-1)
        self.masked_at_start = torch.where(moving, masked, self.masked_at_start)

    def select(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (``(B',)`` long), in that order."""
        self.steps, self.masked_at_start = self.steps[index], self.masked_at_start[index]
        if isinstance(self.generator, RowStreams):
            self.generator.select(index)

    def join(self, block: torch.Tensor, streams: torch.Tensor) -> None:
        """Append rows at the start of their first block ``block`` (``(J, K)`` long) drawing
        from the random streams ``streams`` (``(J,)`` long)."""
        masked_at_start = (block == self.mask_token_id).sum(-1)
        self.steps = torch.cat([self.steps, torch.zeros_like(masked_at_start)])
        self.masked_at_start = torch.cat([self.masked_at_start, masked_at_start])
        if isinstance(self.generator, RowStreams):
            self.generator.join(streams)
