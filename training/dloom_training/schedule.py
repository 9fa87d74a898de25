"""The learning-rate schedule: linear warm-up, then cosine to 5 % of the peak."""

from __future__ import annotations

import math

__all__ = ["MIN_LR_FRACTION", "WARMUP", "learning_rate"]


WARMUP = 100
MIN_LR_FRACTION = 0.05


def learning_rate(step: int, progress: float, peak: float, start: int = 0) -> float:
    """Cosine in ``progress`` (0..1) from ``peak`` to 5 % of it, after a linear warm-up over
    the ``WARMUP`` steps from ``start``: to ``peak`` for a new run (``start`` 0), to the
    scheduled rate for a run continued at step ``start`` (its optimizer moments are new)."""
    progress = min(1.0, max(0.0, progress))
    cosine = peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))
    if step - start < WARMUP:
        return (peak if start == 0 else cosine) * (step - start + 1) / WARMUP
    return cosine
