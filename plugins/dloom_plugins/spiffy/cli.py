"""Spiffy's commands on the ``dloom`` command line: ``dloom calibrate`` (through
:func:`dloom.hooks.specs.dloom_register_commands`; its ``--graph``, ``--budget`` and
``--layout`` options of ``generate``/``eval``/``check`` come from the registration's
``options``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import typer
from rich.progress import Progress

from dloom.sdk import DIFFUSION, ConfigurationError, DloomError, decoder_kind
from dloom.sdk.cli import (
    BlockLengthOption,
    DeviceOption,
    DtypeOption,
    GenLengthOption,
    ModelOption,
    ParamOption,
    RemaskingOption,
    StepsOption,
    StrategyOption,
    TemperatureOption,
    build_decoder,
    check_output,
    fail,
    read_prompts,
    stderr,
    stdout,
)

if TYPE_CHECKING:
    from dloom.sdk import DiffusionDecoder


def register_commands(cli: typer.Typer) -> None:
    """Add ``calibrate`` to ``cli``."""
    cli.command()(calibrate)


def calibrate(
    model: str = ModelOption,
    strategy: str = StrategyOption,
    param: list[str] = ParamOption,
    budget: int = typer.Option(10, "--budget", "-D", min=1, help="D: draft nodes to keep."),
    output: Path = typer.Option(..., "--output", "-o", help="Where to write the graph (JSON)."),
    tasks: str = typer.Option("all", help="'all' or comma-separated task families (training split)."),
    n: int = typer.Option(70, "-n", help="Task prompts to calibrate on."),
    prompts_file: Path | None = typer.Option(
        None, "--prompts", help="JSONL prompts instead of the task suite.", exists=True, dir_okay=False
    ),
    seed: int = typer.Option(0, help="Seeds the example selection and the sampler."),
    token_ranks: int = typer.Option(4, min=1, help="Vocabulary ranks a draft formula may use."),
    score: str = typer.Option("own", help="Node selection score: own or own+parents (the paper's)."),
    gen_length: int | None = GenLengthOption,
    block_length: int | None = BlockLengthOption,
    steps: int | None = StepsOption,
    temperature: float = TemperatureOption,
    remasking: str = RemaskingOption,
    batch_size: int = typer.Option(16, min=1, help="Prompts per forward batch."),
    device: str = DeviceOption,
    dtype: str = DtypeOption,
    force: bool = typer.Option(False, "--force", help="Overwrite --output if it exists."),
) -> None:
    """Record the base strategy's transitions and write a Spiffy draft graph of D nodes."""
    from dloom.sdk.zoo import select_examples

    from .calibrate import calibrate as run_calibration

    try:
        check_output(output, force)
        kind = decoder_kind(strategy)
        if kind != DIFFUSION:
            raise ConfigurationError(
                f"calibrate records a diffusion commit rule's steps; {strategy!r} runs in the "
                f"{kind!r} decoder and takes no draft graph: calibrate a commit rule, "
                "e.g. --strategy quota or --strategy threshold"
            )
        description: dict[str, Any]
        if prompts_file is not None:
            prompts, description = read_prompts(prompts_file), {"prompts_file": str(prompts_file)}
        else:
            prompts = [e.prompt for e in select_examples(tasks, n, seed, split="train")]
            description = {"tasks": tasks, "split": "train", "seed": seed}
        decoder = cast("DiffusionDecoder", build_decoder(  # a diffusion strategy: checked above
            model, strategy, param, device=device, dtype=dtype, gen_length=gen_length,
            block_length=block_length, steps=steps, temperature=temperature,
            remasking=remasking, seed=seed,
        ))
        with Progress(console=stderr(), transient=True) as bar:
            task = bar.add_task("calibrating", total=len(prompts))
            graph = run_calibration(
                decoder, prompts, budget, token_ranks=token_ranks, score=score, batch_size=batch_size,
                description=description, progress=lambda done: bar.update(task, completed=done),
            )
        graph.save(output)
    except DloomError as error:
        fail(error)
    info = graph.calibration
    stdout().print(
        f"wrote {output}: {graph.budget} nodes from {info['paths']} paths over {len(prompts)} "
        f"prompts ({info['distinct_formulas']} distinct formulas), base {decoder.composition.name}, "
        f"block {graph.block_length}"
    )
