"""``dloom profile``: a model's forward cost curve on this machine
(:func:`dloom.model.cost.measure_cost_curve`), printed and optionally saved for
``--param spiffy.cost=FILE``."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from dloom.cli.commands import (
    DeviceOption,
    DtypeOption,
    JsonOption,
    check_output,
    console,
    fail,
)
from dloom.errors import ConfigurationError, DloomError
from dloom.factory import DEFAULT_MODEL


def profile(
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Toy-zoo name or local checkpoint directory."),
    seq_len: int = typer.Option(192, "--seq-len", help="Tokens per row (prompt + generation, or a cached window)."),
    layout: str = typer.Option(
        "rows", help="rows (one batch row per node), packed (one row, a span per node) or cached (a causal "
        "model's forward of N new tokens after --seq-len cached columns: an AR target's step or verification).",
    ),
    span: int = typer.Option(32, help="Tokens per packed node (the block length)."),
    nodes: str = typer.Option("1,2,4,8,16", help="Comma-separated node counts to time."),
    repeats: int = typer.Option(3, help="Timed forwards per point (the median is kept)."),
    device: str = DeviceOption,
    dtype: str = DtypeOption,
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the curve (JSON) here."),
    force: bool = typer.Option(False, "--force", help="Overwrite --output if it exists."),
    as_json: bool = JsonOption,
) -> None:
    """Time the model's forwards against the nodes (rows or packed spans) they evaluate."""
    from dloom import load_model
    from dloom.model.cost import measure_cost_curve

    try:
        if output is not None:
            check_output(output, force)
        try:
            counts = tuple(int(n) for n in nodes.split(","))
        except ValueError:
            raise ConfigurationError(f"--nodes is {nodes!r}; allowed: comma-separated integers, e.g. 1,2,4,8") from None
        adapter = load_model(model, device=device, dtype=dtype, require_mask=layout != "cached")
        curve = measure_cost_curve(adapter, seq_len, counts, layout=layout, span=span, repeats=repeats)
        if output is not None:
            curve.save(output)
    except DloomError as error:
        fail(error)
    if as_json:
        console.print_json(json.dumps(curve.to_json()))
        return
    info = curve.description
    table = Table(title=escape(
        f"forward cost of {info['model']} ({info['device']}, {info['dtype']}, layout {layout}, "
        f"{seq_len} tokens per row, {info['threads']} threads)"
    ))
    for column in ("nodes", "seconds", "relative"):
        table.add_column(column, justify="right")
    for count, seconds in zip(curve.nodes, curve.seconds):
        table.add_row(str(count), f"{seconds * 1000:.2f} ms", f"{curve.relative(count):.2f}x")
    console.print(table)
    if output is not None:
        console.print(f"wrote {output}")
