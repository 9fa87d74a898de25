"""Joint distributions over a few positions, for checking bounds on commit rules.

A *joint* over ``n`` positions with vocabularies ``V_1 .. V_n`` is a float64 numpy array of
shape ``(V_1, ..., V_n)``, non-negative and summing to one: ``joint[t]`` is the probability
that the positions hold the tuple of tokens ``t`` together. Its *marginals* are what a dLLM
shows: one distribution per position, the dependence between positions unseen.

Constructions:

* :func:`dirichlet_joint`: a random joint (a symmetric Dirichlet over all cells).
* :func:`near_degenerate_joint`: almost all mass on one tuple, the rest spread at random.
* :func:`product_joint`: independent positions with the given marginals.
* :func:`circular_coupling`: every position reads one uniform ``u`` on a circle, each through
  its own rotation, direction and token order. Comonotone (all read ``u`` the same way) and
  countermonotone (alternate positions read it backwards) couplings are special cases, and so
  is :func:`frechet_extremal_joint`, where the events "position ``i`` is wrong" sit on
  consecutive, disjoint arcs, the joint that makes all positions right together as rarely as
  the marginals allow.

:func:`prefix_bound_violations` checks a bound ``(L, U, G)`` on one joint. Only numpy is
needed (random draws come from a ``numpy.random.Generator``); the hypothesis strategies
that draw these joints in dloom's own proofs live in ``proofs_tests/joints.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Joint = np.ndarray
Marginals = Sequence[np.ndarray]


# --- reading a joint ---------------------------------------------------------------------


def marginals(joint: Joint) -> list[np.ndarray]:
    """The ``n`` per-position distributions, ``marginals(joint)[i]`` of shape ``(V_i,)``."""
    axes = range(joint.ndim)
    return [joint.sum(axis=tuple(a for a in axes if a != i)) for i in axes]


def greedy(joint: Joint) -> tuple[np.ndarray, np.ndarray]:
    """Each position's greedy token (argmax of its marginal, lowest id on ties) and its
    probability, the confidence a commit rule sees: two ``(n,)`` arrays."""
    margs = marginals(joint)
    tokens = np.array([int(np.argmax(m)) for m in margs])
    return tokens, np.array([m[t] for m, t in zip(margs, tokens)])


def marginalise(joint: Joint, positions: Sequence[int] | np.ndarray) -> Joint:
    """The joint of ``positions`` alone, its axes in the order given."""
    keep = [int(p) for p in positions]
    summed = joint.sum(axis=tuple(a for a in range(joint.ndim) if a not in keep))
    return np.transpose(summed, [sorted(keep).index(p) for p in keep])


def tuple_and_best_rival(joint: Joint, tokens: Sequence[int] | np.ndarray) -> tuple[float, float]:
    """The probability of the tuple ``tokens`` and the largest probability of any other
    tuple (``0`` when there is none)."""
    index = tuple(int(t) for t in tokens)
    others = joint.copy()
    others[index] = -np.inf
    return float(joint[index]), float(max(others.max(), 0.0))


# --- constructing joints -----------------------------------------------------------------


def random_distribution(size: int, peak: float, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """A distribution over ``size`` tokens with mass ``>= peak`` on one random token."""
    noise = rng.dirichlet(np.full(size, alpha))
    dist = (1.0 - peak) * noise
    dist[rng.integers(size)] += peak
    return dist


def dirichlet_joint(shape: Sequence[int], alpha: float, rng: np.random.Generator) -> Joint:
    """A joint drawn from a symmetric Dirichlet over all ``prod(shape)`` cells."""
    cells = int(np.prod(shape))
    return rng.dirichlet(np.full(cells, alpha)).reshape(shape)


def near_degenerate_joint(
    shape: Sequence[int], epsilon: float, alpha: float, rng: np.random.Generator
) -> Joint:
    """Mass ``1 - epsilon`` on one random tuple, ``epsilon`` spread as a Dirichlet joint."""
    joint = epsilon * dirichlet_joint(shape, alpha, rng)
    joint[tuple(int(rng.integers(v)) for v in shape)] += 1.0 - epsilon
    return joint


def product_joint(margs: Marginals) -> Joint:
    """Independent positions with marginals ``margs``."""
    joint = np.ones(())
    for m in margs:
        joint = np.multiply.outer(joint, m)
    return joint


def circular_coupling(
    margs: Marginals,
    orders: Sequence[Sequence[int] | np.ndarray] | None = None,
    offsets: Sequence[float] | None = None,
    reversed_: Sequence[bool] | None = None,
) -> Joint:
    """Couple ``margs`` through one uniform ``u`` on the circle ``[0, 1)``.

    Position ``i`` reads ``v = (offsets[i] + u) mod 1`` (``(offsets[i] - u) mod 1`` when
    ``reversed_[i]``) and takes the token whose slice of ``[0, 1)`` holds ``v``, the slices
    laid out in ``orders[i]`` with lengths from ``margs[i]``. The joint is exact: it adds up
    the lengths of the arcs of ``u`` between consecutive breakpoints.

    :param margs: ``n`` distributions.
    :param orders: each position's token order (default: ``0 .. V_i - 1``).
    :param offsets: rotations (default: all 0).
    :param reversed_: directions (default: all forwards). All defaults: comonotone.
    """
    n = len(margs)
    orders = orders or [range(len(m)) for m in margs]
    offsets = offsets or [0.0] * n
    reversed_ = reversed_ or [False] * n
    cuts, tokens = [], []
    for m, given in zip(margs, orders):
        order = np.asarray(list(given))
        edges = np.concatenate([[0.0], np.cumsum(m[order])])
        edges[-1] = 1.0
        cuts.append(edges)
        tokens.append(order)
    breaks = [np.array([0.0, 1.0])]
    for edges, offset, back in zip(cuts, offsets, reversed_):
        breaks.append(np.mod(offset - edges, 1.0) if back else np.mod(edges - offset, 1.0))
    points = np.unique(np.concatenate(breaks))
    lengths = np.diff(points)
    middles = points[:-1] + lengths / 2
    joint = np.zeros([len(m) for m in margs])
    index = []
    for edges, order, offset, back in zip(cuts, tokens, offsets, reversed_):
        v = np.mod(offset - middles, 1.0) if back else np.mod(offset + middles, 1.0)
        slot = np.clip(np.searchsorted(edges, v, side="right") - 1, 0, len(order) - 1)
        index.append(order[slot])
    np.add.at(joint, tuple(index), lengths)
    return joint


def comonotone_joint(margs: Marginals) -> Joint:
    """All positions increase together with ``u`` (the upper Fréchet coupling for two)."""
    return circular_coupling(margs)


def countermonotone_joint(margs: Marginals) -> Joint:
    """Odd positions read ``u`` backwards: for two positions, the lower Fréchet coupling."""
    return circular_coupling(margs, reversed_=[i % 2 == 1 for i in range(len(margs))])


def frechet_extremal_joint(margs: Marginals) -> Joint:
    """A joint with marginals ``margs`` in which every position's greedy token is right
    together with probability exactly ``max(0, 1 - sum_i (1 - c_i))``.

    Position ``i`` is wrong on the arc ``[a_i, a_i + w_i)`` of the circle, ``w_i = 1 - c_i``
    and ``a_i = w_1 + ... + w_{i-1}``: consecutive arcs that do not overlap while their total
    stays below one, and cover the whole circle once it reaches one.
    """
    greedy_tokens = [int(np.argmax(m)) for m in margs]
    wrong = np.array([1.0 - m[g] for m, g in zip(margs, greedy_tokens)])
    orders = [
        [t for t in range(len(m)) if t != g] + [g] for m, g in zip(margs, greedy_tokens)
    ]
    starts = np.concatenate([[0.0], np.cumsum(wrong)[:-1]])
    return circular_coupling(margs, orders=orders, offsets=list(-starts))


# --- checking a bound --------------------------------------------------------------------


def prefix_bound_violations(joint: Joint, bounds, tolerance: float = 1e-12) -> list[str]:
    """Where ``bounds`` fails on ``joint``: an empty list when it is sound.

    For every ``n``, the ``n`` positions with the most confident greedy tokens (stable order,
    as :func:`dloom.decode.commit.sorted_profile` sorts) must hold their greedy tokens together with
    probability at least ``L_n``, and no other tuple of those positions may be likelier than
    ``U_n``.

    :param bounds: maps a ``(1, n)`` torch float64 profile, sorted descending, to ``(L, U, G)``
        of shape ``(1, n)`` each (e.g. the ``frechet`` strategy's bound, :func:`dloom.check.bounds.resolve_bound`).
    """
    import torch

    tokens, confidence = greedy(joint)
    order = np.argsort(-confidence, kind="stable")
    lower, upper, _ = (b[0].tolist() for b in bounds(torch.tensor(confidence[order])[None]))
    problems = []
    for n in range(1, len(order) + 1):
        prefix = order[:n]
        right, rival = tuple_and_best_rival(marginalise(joint, prefix), tokens[prefix])
        if right < lower[n - 1] - tolerance:
            problems.append(f"n={n}: P(all greedy right)={right!r} < L_n={lower[n - 1]!r}")
        if rival > upper[n - 1] + tolerance:
            problems.append(f"n={n}: a rival tuple has P={rival!r} > U_n={upper[n - 1]!r}")
    return problems
