"""Soundness of a commit rule's declared bound, on random and adversarial joints.

A *bound* is a function from a sorted confidence profile, ``(B, K)`` float64 descending with
``-inf`` past the selectable positions, to ``(L, U, G)`` of the same shape (as
the Fréchet bound of the ``frechet`` strategy). For the ``n`` most confident positions it
claims, whatever the joint distribution behind the per-position marginals:

* ``L_n`` <= the probability that their greedy tokens are all right together;
* ``U_n`` >= the probability of every other tuple of tokens at those positions;

and the commit rule claims a *joint-mode certificate*: whatever it commits (two positions or
more) is the joint mode of the committed positions, its greedy tuple strictly likelier than
every other tuple.

:func:`check_bound` tries both claims on joints drawn from a seeded generator (so a run is
reproducible): *random* ones (Dirichlet over all cells, near-degenerate, independent,
randomly rotated circular couplings) and *adversarial* ones built to break bounds (the
Fréchet-extremal joint, where the greedy tokens are all right as rarely as the marginals
allow, and comonotone and countermonotone couplings), over peaked marginals whose wrong mass
sits on few tokens. The confidences are the greedy tokens' marginal probabilities (the
rule's stated condition: ``T == 0``, ``low_confidence``). Every joint is tried; the
counterexample reported is the failing joint with the fewest cells.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from dloom.check import joints as J
from dloom.check.resolve import Resolved
from dloom.decode.kernel import commit_signals
from dloom.errors import ConfigurationError
from dloom.hooks import calls as hooks
from dloom.hooks.composition import build_plugin_manager, compose
from dloom.hooks.registry import Registry, get_registry
from dloom.types import BlockSchedule

RANDOM_KINDS = ("dirichlet", "near_degenerate", "product", "circular")
ADVERSARIAL_KINDS = ("frechet_extremal", "comonotone", "countermonotone")

Bound = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def known_bounds(registry: Registry | None = None) -> dict[str, Bound]:
    """The named bounds: those the registered strategies' claims supply
    (:attr:`dloom.Claim.bound_function`), by name."""
    strategies = (registry or get_registry()).strategies.values()
    claims = [s.registration.claim for s in strategies]
    return {c.bound: c.bound_function for c in claims if c is not None and c.bound and c.bound_function is not None}


def resolve_bound(name: str, registry: Registry | None = None) -> Bound:
    """The bound function ``name`` stands for: one of :func:`known_bounds` or an import
    path ``"package.module:function"``.

    :raises ConfigurationError: when it cannot be found.
    """
    module_name, sep, attribute = name.partition(":")
    if not sep:
        known = known_bounds(registry)
        if name in known:
            return known[name]
        raise ConfigurationError(
            f"unknown bound {name!r}; known bounds: {', '.join(sorted(known)) or 'none'}, or give an "
            "import path 'package.module:function'"
        )
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ConfigurationError(f"bound {name!r} cannot be loaded: {error}") from None


def random_joint(kind: str, rng: np.random.Generator) -> J.Joint:
    """One joint of ``kind`` over 2-5 positions with vocabularies of 2-6 tokens."""
    shape = tuple(int(v) for v in rng.integers(2, 7, size=int(rng.integers(2, 6))))
    alpha = float(rng.choice([0.05, 0.3, 1.0, 3.0]))
    if kind == "dirichlet":
        return J.dirichlet_joint(shape, alpha, rng)
    if kind == "near_degenerate":
        epsilon = float(rng.choice([0.0, 1e-12, 1e-6, 1e-3, rng.uniform(0, 0.5)]))
        return J.near_degenerate_joint(shape, epsilon, alpha, rng)
    adversarial = kind in ADVERSARIAL_KINDS
    peak = rng.uniform(0.5, 1.0) if adversarial else rng.uniform()
    alpha = 0.05 if adversarial else alpha  # wrong mass on few tokens: rivals as likely as allowed
    margs = [J.random_distribution(v, 1.0 - (1.0 - peak) * rng.uniform(), alpha, rng) for v in shape]
    if kind == "product":
        return J.product_joint(margs)
    if kind == "frechet_extremal":
        return J.frechet_extremal_joint(margs)
    if kind == "comonotone":
        return J.comonotone_joint(margs)
    if kind == "countermonotone":
        return J.countermonotone_joint(margs)
    if kind == "circular":
        return J.circular_coupling(
            margs,
            orders=[rng.permutation(len(m)) for m in margs],
            offsets=list(rng.uniform(size=len(margs))),
            reversed_=list(rng.uniform(size=len(margs)) < 0.5),
        )
    raise ValueError(f"unknown joint kind {kind!r}")


@dataclass(frozen=True)
class BoundOptions:
    """How many joints :func:`check_bound` tries, and the seed of their generator."""

    random_joints: int = 400
    adversarial_joints: int = 400
    seed: int = 0


@dataclass(frozen=True)
class BoundCheck:
    """The outcome of :func:`check_bound`.

    :ivar verdict: ``"sound"`` or ``"unsound"``.
    :ivar counterexample: ``None``, or the smallest failing joint found: its index in the
        seeded sequence, kind, shape, probabilities and marginals, the confidences and what
        failed.
    :ivar counterexamples: how many of the joints tried were counterexamples.
    :ivar certified_commits: joints on which the rule committed two positions or more (the
        certificate was exercised that many times).
    """

    verdict: str
    bound: str | None
    random_joints: int
    adversarial_joints: int
    certified_commits: int
    seed: int
    counterexamples: int
    counterexample: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _describe(joint: J.Joint, kind: str, index: int, problem: str, **more: Any) -> dict[str, Any]:
    tokens, confidence = J.greedy(joint)
    record = {
        "joint": index, "kind": kind, "shape": list(joint.shape), "problem": problem,
        "greedy_tokens": tokens.tolist(), "confidence": confidence.tolist(),
        "marginals": [m.tolist() for m in J.marginals(joint)], **more,
    }
    record["probabilities"] = joint.tolist()
    return record


def _signals(joint: np.ndarray, tokens: np.ndarray, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The signals ``names`` a commit rule sees for ``joint``: those of its marginals (one
    row, ``(1, n, V)`` with ``V`` the largest vocabulary, zero-padded), the greedy ``tokens``
    the candidates."""
    margs = J.marginals(joint)
    probs = torch.zeros(1, len(margs), max(len(m) for m in margs), dtype=torch.float64)
    for position, marginal in enumerate(margs):
        probs[0, position, : len(marginal)] = torch.from_numpy(np.asarray(marginal, dtype=np.float64))
    mask_id = probs.shape[-1]  # a column of -inf logits past the vocabulary: never a candidate
    logits = torch.cat([probs.log(), torch.full_like(probs[..., :1], -torch.inf)], dim=-1)
    masked = torch.full((1, len(margs)), mask_id, dtype=torch.long)  # the rule sees every position masked
    signals = commit_signals(logits, torch.from_numpy(tokens)[None], masked, names, mask_id)
    if "probabilities" in signals:
        signals["probabilities"] = signals["probabilities"][..., :mask_id]
    return signals


def check_bound(
    strategy: Resolved,
    bound: str | None,
    options: BoundOptions = BoundOptions(),
    tolerance: float = 1e-12,
) -> BoundCheck:
    """Try ``strategy``'s commit rule and the bound ``bound`` (skipped when ``None``) on
    ``options.random_joints + options.adversarial_joints`` joints; report the smallest
    counterexample."""
    bound_function = resolve_bound(bound) if bound is not None else None
    pm = build_plugin_manager(compose(strategy.spec, strategy.params))
    names = hooks.declared_signals(pm)
    rng = np.random.default_rng(options.seed)
    kinds = [RANDOM_KINDS[i % len(RANDOM_KINDS)] for i in range(options.random_joints)]
    kinds += [ADVERSARIAL_KINDS[i % len(ADVERSARIAL_KINDS)] for i in range(options.adversarial_joints)]
    certified, found, smallest = 0, 0, None
    for index, kind in enumerate(kinds):
        joint = random_joint(kind, rng)
        failure: tuple[str, dict[str, Any]] | None = None
        if bound_function is not None:
            problems = J.prefix_bound_violations(joint, bound_function, tolerance)
            if problems:
                failure = (f"bound {bound!r}: {problems[0]}", {})
        if failure is None:
            tokens, confidence = J.greedy(joint)
            width = len(tokens)
            selectable = torch.ones(1, width, dtype=torch.bool)
            schedule = BlockSchedule(torch.zeros(1, dtype=torch.long), 1, torch.tensor([width]))
            signals = _signals(joint, tokens, names) if names else None
            commit = hooks.select_commit(pm, torch.tensor(confidence)[None], selectable, schedule, signals)
            positions = np.flatnonzero(commit[0].numpy())
            if len(positions) >= 2:
                certified += 1
                right, rival = J.tuple_and_best_rival(J.marginalise(joint, positions), tokens[positions])
                if not right > rival:
                    failure = (
                        "the committed tokens are not the joint mode of the committed positions",
                        dict(committed=positions.tolist(), p_committed_tuple=right, p_best_rival=rival),
                    )
        if failure is not None:
            found += 1
            if smallest is None or joint.size < smallest[0].size:
                smallest = (joint, kind, index, failure)
    counterexample = None
    if smallest is not None:
        joint, kind, index, (problem, more) = smallest
        counterexample = _describe(joint, kind, index, problem, **more)
    return BoundCheck(
        "sound" if counterexample is None else "unsound", bound, options.random_joints,
        options.adversarial_joints, certified, options.seed, found, counterexample,
    )
