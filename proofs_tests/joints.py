"""Hypothesis strategies that draw joint distributions, and the least all-right probability.

The joints themselves and the bound check live in the package, :mod:`dloom.check.joints`
(``dloom check`` uses them too); they are re-exported here so the proofs import one module.
:func:`min_all_right` solves a linear programme (scipy), for the sharpness proofs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.optimize
from hypothesis import strategies as st

from dloom.check.joints import (  # noqa: F401 - re-exported for the proofs
    Joint,
    Marginals,
    circular_coupling,
    comonotone_joint,
    countermonotone_joint,
    dirichlet_joint,
    frechet_extremal_joint,
    greedy,
    marginalise,
    marginals,
    near_degenerate_joint,
    prefix_bound_violations,
    product_joint,
    random_distribution,
    tuple_and_best_rival,
)


def min_all_right(margs: Marginals, tokens: Sequence[int]) -> float:
    """The least probability that every position ``i`` holds ``tokens[i]``, over all joints
    with marginals ``margs``: a linear programme over the joint's cells (HiGHS)."""
    shape = [len(m) for m in margs]
    cells = int(np.prod(shape))
    grid = np.indices(shape).reshape(len(shape), cells)
    rows, rhs = [], []
    for i, m in enumerate(margs):
        for v in range(len(m)):
            rows.append((grid[i] == v).astype(float))
            rhs.append(m[v])
    cost = np.zeros(cells)
    cost[np.ravel_multi_index(tuple(int(t) for t in tokens), shape)] = 1.0
    result = scipy.optimize.linprog(
        cost, A_eq=np.array(rows), b_eq=np.array(rhs), bounds=(0, None), method="highs"
    )
    assert result.status == 0, result.message
    return float(result.fun)


# --- hypothesis strategies ---------------------------------------------------------------

ALPHAS = st.sampled_from([0.05, 0.3, 1.0, 3.0])
EPSILONS = st.one_of(st.sampled_from([0.0, 1e-12, 1e-6, 1e-3]), st.floats(0.0, 0.5))
KINDS = (
    "dirichlet", "near_degenerate", "product", "comonotone", "countermonotone", "circular",
    "frechet_extremal",
)


@st.composite
def shapes(draw, positions=(2, 5), vocab=(2, 6)) -> tuple[int, ...]:
    n = draw(st.integers(*positions))
    return tuple(draw(st.integers(*vocab)) for _ in range(n))


@st.composite
def marginal_lists(draw, positions=(2, 5), vocab=(2, 6)) -> list[np.ndarray]:
    """Per-position distributions, from flat to peaked (a drawn floor on the peak)."""
    shape = draw(shapes(positions, vocab))
    peak = draw(st.floats(0.0, 1.0))
    alpha = draw(ALPHAS)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return [
        random_distribution(v, 1.0 - (1.0 - peak) * rng.uniform(), alpha, rng) for v in shape
    ]


@st.composite
def joints(draw, positions=(2, 5), vocab=(2, 6), kinds=KINDS) -> Joint:
    """A joint of one of ``kinds``: random, near-degenerate, independent, or a coupling of
    random marginals (comonotone, countermonotone, randomly rotated, Fréchet-extremal)."""
    kind = draw(st.sampled_from(kinds))
    if kind in ("dirichlet", "near_degenerate"):
        shape = draw(shapes(positions, vocab))
        alpha = draw(ALPHAS)
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        if kind == "dirichlet":
            return dirichlet_joint(shape, alpha, rng)
        return near_degenerate_joint(shape, draw(EPSILONS), alpha, rng)
    margs = draw(marginal_lists(positions, vocab))
    if kind == "product":
        return product_joint(margs)
    if kind == "comonotone":
        return comonotone_joint(margs)
    if kind == "countermonotone":
        return countermonotone_joint(margs)
    if kind == "frechet_extremal":
        return frechet_extremal_joint(margs)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return circular_coupling(
        margs,
        orders=[rng.permutation(len(m)) for m in margs],
        offsets=list(rng.uniform(size=len(margs))),
        reversed_=list(rng.uniform(size=len(margs)) < 0.5),
    )
