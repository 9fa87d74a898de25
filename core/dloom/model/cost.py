"""What a forward costs on the hardware it runs on: a measured cost curve.

A speculative strategy trades forwards for bigger forwards: one verification evaluates a
batch row's current block and ``D`` drafts, ``D + 1`` *nodes*, laid out as ``D + 1`` rows
(``layout="rows"``) or packed into one longer row (``layout="packed"``, each draft a span
of ``span`` more tokens). Whether that pays depends on how the forward's wall time grows
with its nodes: on a CPU it grows about linearly, on an accelerator running a large model
at small batch a forward is bound by reading the weights and stays nearly flat.

:func:`measure_cost_curve` times forwards of ``1, 2, 4, ...`` nodes on the model itself
(a few warm-up forwards, then the median of ``repeats`` rounds, each timing every node
count in turn, so that a machine's changing load falls on every point alike; each timed
forward follows an untimed one of its shape, as in decoding), and keeps the curve for the
process, keyed by the model's name, device, dtype, the layout and the shapes. A
:class:`CostCurve` interpolates between the measured points; :meth:`CostCurve.linear` and
:meth:`CostCurve.flat` build synthetic curves (a CPU-like and a GPU-like forward).

The forwards measured are uncached forwards over a sequence of ``seq_len`` tokens with no
attention mask: what the rows layout costs without a cache. With a prefix or dual cache a
verification row computes a window of the sequence, not all of it; measure with
``seq_len`` set to that window's width to approximate it. ``layout="cached"`` times what an
autoregressive target runs instead: a causal model's forward of ``n`` new tokens continuing
its KV cache of ``seq_len`` columns (:class:`dloom.ar.target.ARTarget`; ``n = 1`` is a plain
decoding step, ``n = k + 1`` the verification of a ``k``-token chain).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dloom.errors import ConfigurationError
from dloom.model.adapter import ModelAdapter

FORMAT = "dloom-cost-curve"
VERSION = 1
LAYOUTS = ("rows", "packed", "cached")
NODES = (1, 2, 4, 8, 16)
"""The node counts :func:`measure_cost_curve` times by default."""


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one forward against the nodes it evaluates per batch row.

    :ivar nodes: increasing node counts (``>= 1``), at least one.
    :ivar seconds: the forward's wall time at each, ``> 0``.
    :ivar description: how it was obtained (model, device, dtype, layout, shapes).
    """

    nodes: tuple[int, ...]
    seconds: tuple[float, ...]
    description: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.nodes or len(self.nodes) != len(self.seconds):
            raise ConfigurationError(
                f"a cost curve needs as many node counts as times, at least one; got "
                f"{list(self.nodes)} and {list(self.seconds)}"
            )
        if any(n < 1 for n in self.nodes) or any(b <= a for a, b in zip(self.nodes, self.nodes[1:])):
            raise ConfigurationError(f"cost curve node counts are {list(self.nodes)}; allowed: increasing, >= 1")
        if any(not s > 0 for s in self.seconds):
            raise ConfigurationError(f"cost curve times are {list(self.seconds)}; allowed: > 0 seconds")

    def __call__(self, nodes: float) -> float:
        """Seconds of a forward of ``nodes`` nodes: linear between measured points, the
        first point's time below it, and the last segment's slope past the last point
        (never below the last time)."""
        xs, ys = self.nodes, self.seconds
        if nodes <= xs[0] or len(xs) == 1:
            return ys[0] if nodes <= xs[0] else ys[-1]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if nodes <= x1:
                return y0 + (y1 - y0) * (nodes - x0) / (x1 - x0)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return max(ys[-1], ys[-1] + slope * (nodes - xs[-1]))

    def relative(self, nodes: float) -> float:
        """The cost of ``nodes`` nodes in forwards of one node."""
        return self(nodes) / self(1)

    @classmethod
    def linear(cls, base: float, per_node: float, up_to: int = 64) -> CostCurve:
        """A synthetic curve ``base + per_node * (nodes - 1)`` (a compute-bound forward)."""
        return cls((1, up_to), (base, base + per_node * (up_to - 1)), {"synthetic": "linear"})

    @classmethod
    def flat(cls, seconds: float = 1.0) -> CostCurve:
        """A synthetic curve that costs ``seconds`` at any node count (a forward bound by
        reading the weights, as on an accelerator at small batch)."""
        return cls((1,), (seconds,), {"synthetic": "flat"})

    # --- file format -------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, **dict(self.description),
            "points": [{"nodes": n, "seconds": s} for n, s in zip(self.nodes, self.seconds)],
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "cost curve") -> CostCurve:
        """Parse a curve written by :meth:`to_json`.

        :raises ConfigurationError: naming the source and what is wrong.
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ConfigurationError(
                f"{source} is not a dloom cost curve (expected 'format': {FORMAT!r}, 'version': {VERSION})"
            )
        points = data.get("points")
        if not isinstance(points, list) or not all(
            isinstance(p, dict) and isinstance(p.get("nodes"), int) and isinstance(p.get("seconds"), (int, float))
            for p in points
        ):
            raise ConfigurationError(f"{source}: 'points' must be a list of {{'nodes': int, 'seconds': number}}")
        description = {k: v for k, v in data.items() if k not in ("format", "version", "points")}
        return cls(tuple(p["nodes"] for p in points), tuple(float(p["seconds"]) for p in points), description)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostCurve:
        """Read a curve file.

        :raises ConfigurationError: for a missing, unreadable or malformed file.
        """
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigurationError(f"cost curve file {str(path)!r} does not exist") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ConfigurationError(f"malformed cost curve {str(path)!r}: {error}") from None
        return cls.from_json(data, repr(str(path)))


_MEASURED: dict[tuple[Any, ...], CostCurve] = {}


def measure_cost_curve(
    model: ModelAdapter, seq_len: int, nodes: Sequence[int] = NODES, layout: str = "rows",
    span: int = 32, repeats: int = 3, warmup: int = 2,
) -> CostCurve:
    """Time the model's forwards at each node count (cached for the process).

    :param model: the model.
    :param seq_len: tokens of one row (prompt and generation, or a cached window).
    :param nodes: node counts to time, increasing, ``>= 1``.
    :param layout: ``"rows"`` (``n`` rows of ``seq_len``), ``"packed"`` (one row of
        ``seq_len + (n - 1) * span`` tokens) or ``"cached"`` (``n`` new tokens of one row after
        ``seq_len`` cached columns: a causal model with a KV cache).
    :param span: tokens per packed draft (the block length).
    :param repeats: timed rounds (per point, an untimed forward then a timed one of the same
        shape); each point's median is kept.
    :param warmup: untimed forwards before the first point.
    :raises ConfigurationError: for a layout, length, count or node list out of range.
    :raises ModelError: ``"cached"`` for a model that is not causal or takes no cache.
    """
    if layout not in LAYOUTS:
        raise ConfigurationError(f"layout is {layout!r}; allowed: {', '.join(LAYOUTS)}")
    for name, value, low in (("seq_len", seq_len, 1), ("span", span, 1), ("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigurationError(f"{name} is {value!r}; allowed: an integer >= {low}")
    nodes = tuple(nodes)
    if not nodes or any(n < 1 for n in nodes) or any(b <= a for a, b in zip(nodes, nodes[1:])):
        raise ConfigurationError(f"nodes are {list(nodes)}; allowed: increasing integers >= 1")
    key = (model.name, str(model.device), str(model.dtype), layout, seq_len, span, nodes)
    if key not in _MEASURED:
        sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

        target = None
        if layout == "cached":
            from dloom.ar.target import ARTarget

            target = ARTarget(model)
            context = torch.zeros(1, seq_len + 1, dtype=torch.long, device=model.device)
            target.reset(context, torch.ones_like(context), nodes[-1])  # caches seq_len columns

        def forward(n: int) -> None:
            if target is not None:
                new = torch.zeros(1, n, dtype=torch.long, device=model.device)
                target.forward(new, torch.ones_like(new))
                target.crop(seq_len)
                return
            shape = (n, seq_len) if layout == "rows" else (1, seq_len + (n - 1) * span)
            model.raw_logits(torch.zeros(shape, dtype=torch.long, device=model.device))

        for _ in range(warmup):
            forward(nodes[0])
        sync()
        times: dict[int, list[float]] = {n: [] for n in nodes}
        for _ in range(repeats):  # rounds over every node count: a load that drifts hits each alike
            for n in nodes:
                # untimed first: a small forward right after a large one runs on cold caches
                # (on a CPU, 25 % slower for one row after eleven), which decoding, a run of
                # forwards of one shape, does not
                forward(n)
                sync()
                started = time.perf_counter()
                forward(n)
                sync()
                times[n].append(time.perf_counter() - started)
        seconds = [max(statistics.median(times[n]), 1e-9) for n in nodes]
        if target is not None:
            target.release()
        # a forward of more nodes never costs less (timer noise on a near-flat curve)
        monotone = [max(seconds[: i + 1]) for i in range(len(seconds))]
        _MEASURED[key] = CostCurve(nodes, tuple(monotone), {
            "model": model.name, "device": str(model.device),
            "dtype": str(model.dtype).removeprefix("torch."), "layout": layout,
            "seq_len": seq_len, "span": span, "repeats": repeats,
            "threads": torch.get_num_threads(),
        })
    return _MEASURED[key]
