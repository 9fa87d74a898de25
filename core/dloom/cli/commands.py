"""The ``dloom`` command line: generate, eval, demo, check claims, and list plugins and strategies.

Plugins add their own commands and strategy options (:mod:`dloom.cli.plugins`); the helpers
here (:func:`fail`, :func:`build_decoder`, :func:`read_prompts`, :func:`check_output`, the
``*Option`` defaults) are theirs to use too. Decoders are built by :mod:`dloom.factory`, which
raises :class:`~dloom.errors.DloomError`; the commands print those with :func:`fail`.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from dloom.cli.exits import write_results
from dloom.cli.plugins import DloomGroup, StrategyOptionsCommand
from dloom.errors import ConfigurationError, DloomError, OutputError
from dloom.factory import DEFAULT_MODEL, build_decoder, parse_params
from dloom.hooks.registry import DEFAULT_STRATEGY

app = typer.Typer(
    cls=DloomGroup,
    add_completion=False,
    no_args_is_help=True,
    help="dloom: faster decoding for diffusion language models, without changing what they say.",
)
console = Console()
err_console = Console(stderr=True)


def fail(error: Exception) -> None:
    """Print a dloom error and exit with status 2."""
    err_console.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False)
    raise typer.Exit(code=2)


def read_prompt_records(path: Path) -> tuple[list[Any], list[str]]:
    """Prompts from a JSONL file whose lines carry ``"prompt"`` (text) or ``"input_ids"``,
    with each prompt's ``file:line`` (ids are kept as written; :func:`dloom.
    prompt_validation.check_prompts` refuses floats, bools and ids outside the vocabulary).

    :raises ConfigurationError: naming the line that is not UTF-8, not JSON or not a prompt.
    """
    prompts: list[Any] = []
    sources: list[str] = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ConfigurationError(
                f"{path}:{number} is not UTF-8 text (byte {raw[error.start]:#04x} at column "
                f"{error.start + 1}); save the file as UTF-8"
            ) from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigurationError(f"{path}:{number} is not valid JSON: {error}") from None
        except RecursionError:
            raise ConfigurationError(
                f"{path}:{number} nests JSON too deeply; allowed: a prompt object"
            ) from None
        if isinstance(record, dict) and isinstance(record.get("prompt"), str):
            prompts.append(record["prompt"])
        elif isinstance(record, dict) and isinstance(record.get("input_ids"), list):
            prompts.append(record["input_ids"])
        else:
            raise ConfigurationError(
                f"{path}:{number} needs a \"prompt\" string or an \"input_ids\" list"
            )
        sources.append(f"{path}:{number}")
    if not prompts:
        raise ConfigurationError(f"{path} holds no prompts")
    return prompts, sources


def read_prompts(path: Path) -> list[str | list[int]]:
    """The prompts of :func:`read_prompt_records`, without their lines."""
    return read_prompt_records(path)[0]


def batches(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def plan_batches(decoder: Any, prompts: list[Any], batch_size: int, max_batch_tokens: int | None,
                 sources: list[str] | None = None) -> int:
    """Check every prompt against the decoder's model (before any decoding) and return the
    batch size that fits ``max_batch_tokens`` or the memory budget, saying so when it is
    smaller than ``batch_size``."""
    from dloom.decode.batching import plan_batch_size
    from dloom.decode.prompts import check_prompts

    rows = check_prompts(decoder.model, prompts, sources=sources)
    generated = decoder.config["gen_length"]
    length = max(len(r) for r in rows) + generated
    plan = plan_batch_size(decoder.model, batch_size, length, max_batch_tokens)
    note = plan.note(length)
    if note:
        err_console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    return plan.size


def named_table(*columns: str, names: list[str], title: str | None = None) -> Table:
    """A table whose first column (strategy or task names) is never cut, even at 80 columns."""
    table = Table(title=title)
    width = max([len(columns[0]), *map(len, names)])
    table.add_column(columns[0], no_wrap=True, min_width=width)
    for column in columns[1:]:
        table.add_column(column, overflow="fold")
    return table


def write_jsonl(records: list[dict[str, Any]], out: TextIO | None = None) -> None:
    """Write records as JSON lines to ``out`` (default ``sys.stdout``) in one write and
    flush, so what finished survives.

    :raises OutputError: when the stream cannot take them (a full disk, a file over its
        size limit), naming it; the command then exits with status 74.
    """
    write_results(out or sys.stdout, "".join(json.dumps(record) + "\n" for record in records))


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold Ctrl-C until the enclosed block is done (then raise it): lines written and
    counted together. Only the main thread can install a signal handler; elsewhere the block
    runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: received.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


class JsonlStream:
    """The rows of ``--json``, written as their batch finishes and counted, so that after
    Ctrl-C the rows finished but not yet written can be added (:meth:`catch_up`)."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.written = 0
        self.out = out

    def __call__(self, records: list[dict[str, Any]]) -> None:
        with deferred_interrupt():
            write_jsonl(records, self.out)
            self.written += len(records)

    def catch_up(self, records: list[dict[str, Any]]) -> None:
        """Write ``records[written:]``: every finished row, each once."""
        self(records[self.written :])


@contextmanager
def progress_bar(
    label: str, total: int, then: Callable[[list[dict[str, Any]]], None] | None = None,
) -> Iterator[Callable[[list[dict[str, Any]]], None]]:
    """A transient progress bar on stderr over ``total`` examples, and the ``on_batch``
    callback of :func:`dloom.evaluation.evaluate` that advances it by each batch's records
    after handing them to ``then`` (``dloom eval --json``'s stream). The library draws
    nothing; the command line draws from its callback. Drawn on a terminal only (elsewhere
    a transient bar would leave a blank line behind)."""
    with Progress(console=err_console, transient=True, disable=not err_console.is_terminal) as bar:
        task = bar.add_task(label, total=total)

        def advance(records: list[dict[str, Any]]) -> None:
            if then is not None:
                then(records)
            bar.advance(task, len(records))

        yield advance


def interrupted(done: int, total: int, kept: str) -> None:
    """Report Ctrl-C with what was kept and exit with status 130."""
    err_console.print(f"[yellow]interrupted:[/] {done} of {total} {kept}", highlight=False)
    raise typer.Exit(code=130)


ModelOption = typer.Option(
    None, "--model", "-m", help=f"Toy-zoo name or local checkpoint directory (default {DEFAULT_MODEL})."
)
MaxBatchTokensOption = typer.Option(
    None, "--max-batch-tokens", min=1,
    help="Cap on prompts x (prompt + generated) tokens per batch (default: fit a 2 GiB budget).",
)
StrategyOption = typer.Option(DEFAULT_STRATEGY, "--strategy", "-s", help="Strategy name(s), joined with '+'.")
ParamOption = typer.Option([], "--param", "-p", help="Strategy parameter NAME=VALUE (repeatable).")
GenLengthOption = typer.Option(None, help="Generated positions (default: the model's, else 128).")
BlockLengthOption = typer.Option(None, help="Positions per block (default min(32, gen_length)).")
StepsOption = typer.Option(None, help="Step budget for quota rules (default gen_length).")
TemperatureOption = typer.Option(0.0, help="0 = greedy; > 0 samples.")
RemaskingOption = typer.Option("low_confidence", help="low_confidence, random, margin or entropy.")
CacheOption = typer.Option(
    "none", "--cache", help="KV cache policy (listed when the command line is built)."
)
CacheRefreshOption = typer.Option(
    None, "--cache-refresh", help="With --cache: a full forward every N forwards of a block (default: once per block)."
)
StaticShapesOption = typer.Option(
    False, "--static-shapes",
    help="Give every forward static shapes (a preallocated cache written in place), for torch.compile.",
)
DeviceOption = typer.Option("cpu", help="torch device, e.g. cpu or cuda.")
DtypeOption = typer.Option("float32", help="float32, float64, bfloat16 or float16.")
JsonOption = typer.Option(False, "--json", help="Machine-readable output.")
TargetOption = typer.Option(None, "--target", help="AR target of an AR-target strategy, e.g. failfast (default toy-ar).")
DrafterOption = typer.Option(None, "--drafter", help="dLLM drafter of an AR-target strategy, e.g. failfast (default toy-dllm).")


@app.command(cls=StrategyOptionsCommand)
def generate(
    prompt: list[str] | None = typer.Argument(None, help="Prompt texts."),
    model: str = ModelOption,
    strategy: str = StrategyOption,
    param: list[str] = ParamOption,
    prompts_file: Path | None = typer.Option(None, "--prompts", help="JSONL file of prompts.", exists=True, dir_okay=False),
    gen_length: int | None = GenLengthOption,
    block_length: int | None = BlockLengthOption,
    steps: int | None = StepsOption,
    temperature: float = TemperatureOption,
    seed: int | None = typer.Option(None, help="Seed of the sampler."),
    remasking: str = RemaskingOption,
    cache: str = CacheOption,
    cache_refresh: int | None = CacheRefreshOption,
    static_shapes: bool = StaticShapesOption,
    batch_size: int = typer.Option(8, min=1, help="Prompts per forward batch."),
    max_batch_tokens: int | None = MaxBatchTokensOption,
    mask_token_id: int | None = typer.Option(None, help="Override the model's mask token id."),
    trust_remote_code: bool = typer.Option(False, help="Allow the checkpoint's own modelling code."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each text prompt in the tokenizer's chat template."),
    device: str = DeviceOption,
    dtype: str = DtypeOption,
    device_map: str | None = typer.Option(None, help="from_pretrained device_map, e.g. auto (overrides --device)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per prompt."),
    target: str | None = TargetOption,
    drafter: str | None = DrafterOption,
) -> None:
    """Decode prompts with a strategy and print the texts and metrics.

    With --json each prompt's row is written (and flushed) as soon as its batch finishes,
    so Ctrl-C (exit status 130) or a late error keeps what was decoded.
    """
    rows: list[dict[str, Any]] = []
    prompts: list[Any] = []
    stream = JsonlStream()
    try:
        if prompts_file is not None and prompt:
            raise ConfigurationError("give prompts as arguments or with --prompts, not both")
        if prompts_file is not None:
            prompts, sources = read_prompt_records(prompts_file)
        else:
            prompts, sources = list(prompt or []), None
        if not prompts:
            raise ConfigurationError("no prompts: pass PROMPT arguments or --prompts FILE.jsonl")
        decoder = build_decoder(
            model, strategy, param, mask_token_id=mask_token_id,
            trust_remote_code=trust_remote_code, device=device, dtype=dtype, device_map=device_map,
            gen_length=gen_length, block_length=block_length, steps=steps,
            temperature=temperature, remasking=remasking, seed=seed, cache=cache,
            cache_refresh=cache_refresh, target=target, drafter=drafter,
            **({"static_shapes": True} if static_shapes else {}),
        )
        if chat:
            if not all(isinstance(p, str) for p in prompts):
                raise ConfigurationError("--chat applies to text prompts; input_ids are used as given")
            prompts = decoder.model.chat_prompts(prompts)
        batch_size = plan_batches(decoder, prompts, batch_size, max_batch_tokens, sources)
        if batch_size > 1 and not decoder.model.can_pad:
            err_console.print(
                f"[yellow]note:[/] {escape(decoder.model.name)} cannot take a padded batch; "
                "decoding one prompt at a time", highlight=False,
            )
            batch_size = 1
        with Progress(console=err_console, transient=True, disable=len(prompts) <= batch_size) as bar:
            task = bar.add_task("decoding", total=len(prompts))
            for chunk in batches(prompts, batch_size):
                result = decoder.generate(chunk, row_offset=len(rows))
                finished = [result.row(i) for i in range(len(chunk))]
                rows.extend(finished)
                if as_json:
                    stream(finished)
                bar.advance(task, len(chunk))
    except KeyboardInterrupt:
        if as_json:
            stream.catch_up(rows)
        else:
            print_rows(rows)
        interrupted(len(rows), len(prompts), "prompts decoded" + (" and written" if as_json else ""))
    except OutputError:
        raise  # the results cannot be written: status 74 (dloom.cli.exits.end_quietly), not a refused input
    except DloomError as error:
        if rows and as_json:
            err_console.print(f"{len(rows)} rows were written before the error", highlight=False)
        fail(error)
    if not as_json:
        print_rows(rows)


def print_rows(rows: list[dict[str, Any]]) -> None:
    """The table of ``dloom generate``."""
    table = Table("#", "text", "NFE", "TPF", "TPS")
    for index, row in enumerate(rows):
        text = row["text"] if row["text"] is not None else " ".join(map(str, row["tokens"]))
        table.add_row(str(index), text, str(row["nfe"]), f"{row['tpf']:.2f}", f"{row['tps']:.1f}")
    console.print(table)


@app.command("eval", cls=StrategyOptionsCommand)
def eval_command(
    model: str = ModelOption,
    strategy: str = StrategyOption,
    param: list[str] = ParamOption,
    tasks: str = typer.Option(
        "auto", help="'auto' (the suite the model's tokenizer writes: 'long' for the long-answer zoo, "
        "else 'all'), 'all' (the toy suite), 'long', or comma-separated task families of one suite.",
    ),
    n: int = typer.Option(100, "-n", help="Held-out examples (balanced over families)."),
    split: str = typer.Option(
        "held-out", help="'held-out' (what evaluations score) or 'dev' (other held-out prompts, never one of the "
        "first 500 held-out ones: choose settings on dev, score them on held-out).",
    ),
    seed: int = typer.Option(0, help="Seeds the example selection and the sampler."),
    gen_length: int | None = GenLengthOption,
    block_length: int | None = BlockLengthOption,
    steps: int | None = StepsOption,
    temperature: float = TemperatureOption,
    remasking: str = RemaskingOption,
    cache: str = CacheOption,
    cache_refresh: int | None = CacheRefreshOption,
    static_shapes: bool = StaticShapesOption,
    batch_size: int = typer.Option(32, min=1, help="Prompts per forward batch."),
    max_batch_tokens: int | None = MaxBatchTokensOption,
    device: str = DeviceOption,
    dtype: str = DtypeOption,
    outputs: bool = typer.Option(False, help="Include every decoded output in the JSON."),
    as_json: bool = JsonOption,
    target: str | None = TargetOption,
    drafter: str | None = DrafterOption,
    ray_actors: int | None = typer.Option(
        None, "--ray", min=1,
        help="Decode on Ray with N actors, one model replica each (pip install -e \".[ray]\" in a clone of dloom).",
    ),
    oracle: bool = typer.Option(
        False, help="Also report the oracle NFE (oracle_nfe_mean; two extra greedy decodes per example)."
    ),
) -> None:
    """Accuracy per task family, NFE, TPF and TPS of a strategy on the held-out task suite.

    With --json: one JSON line per example as its batch finishes (flushed), then one summary
    line (the report; "complete": false after Ctrl-C, which exits with status 130 and keeps
    the examples that finished, and after an error in a later batch, which is reported after
    the summary of the batches before it, with status 2).
    """
    from dloom.decode.oracle import check_decoder
    from dloom.errors import EvaluationFailed, EvaluationInterrupted
    from dloom.evaluation import (
        add_oracle,
        evaluate,
        select_examples,
        workload_suite,
    )
    from dloom.model.adapter import load_tokenizer

    examples: list[Any] = []
    stream = JsonlStream(sys.stdout)  # taken now: Ray's messages go to stderr while it runs
    decoder = None
    try:
        if split not in ("held-out", "dev"):
            raise ConfigurationError(f"--split is {split!r}; allowed: 'held-out', 'dev'")
        if tasks == "auto":  # the tokenizer that writes the prompts: the diffusion model's, or the AR target's
            tasks = workload_suite(load_tokenizer(model or target or DEFAULT_MODEL)) or "all"
        examples = select_examples(tasks, n, seed, split=split)
        params = list(param)
        settings: dict[str, Any] = dict(
            gen_length=gen_length, block_length=block_length, steps=steps, temperature=temperature,
            remasking=remasking, seed=seed, cache=cache, cache_refresh=cache_refresh,
            **({"static_shapes": True} if static_shapes else {}),
        )
        if ray_actors is not None:  # each actor builds the decoder; its errors come back as dloom's
            if oracle:
                raise ConfigurationError("--oracle decodes in this process; it does not combine with --ray")
            from dloom.ray import DecodeSpec, evaluate_on_ray
            from dloom.ray.batch import driver_prints_to_stderr

            spec = DecodeSpec(model, strategy, tuple(params), settings, device, dtype, target, drafter)
            with driver_prints_to_stderr():  # stdout carries the JSON lines only (stream.out)
                report = evaluate_on_ray(spec, examples, ray_actors, batch_size, on_batch=stream if as_json else None)
        else:
            decoder = build_decoder(
                model, strategy, params, device=device, dtype=dtype, target=target, drafter=drafter, **settings,
            )
            if oracle:
                check_decoder(decoder)
            batch_size = plan_batches(decoder, [e.prompt for e in examples], batch_size, max_batch_tokens)
            with progress_bar(f"eval {decoder.name}", len(examples), stream if as_json else None) as on_batch:
                report = evaluate(decoder, examples, batch_size=batch_size, on_batch=on_batch)
            if oracle:
                add_oracle(report, decoder, examples)
    except EvaluationInterrupted as stop:
        if as_json:
            stream.catch_up(stop.partial.outputs)
        print_report(stop.partial, as_json, outputs, None)
        interrupted(stop.partial.n, len(examples), "examples evaluated; the summary covers those")
    except KeyboardInterrupt:
        interrupted(0, len(examples), "examples evaluated")
    except EvaluationFailed as stop:
        if isinstance(stop.__cause__, OutputError):  # the results cannot be written: status 74
            raise stop.__cause__ from None
        if as_json:
            stream.catch_up(stop.partial.outputs)
        print_report(stop.partial, as_json, outputs, None)
        fail(stop)
    except OutputError:
        raise  # the results cannot be written: status 74 (dloom.cli.exits.end_quietly), not a refused input
    except DloomError as error:
        fail(error)
    print_report(report, as_json, outputs, None if decoder is None else decoder.totals())


def print_report(report: Any, as_json: bool, outputs: bool, totals: dict[str, Any] | None) -> None:
    """The summary of ``dloom eval``: a JSON line, or the tables (``totals``: the
    decoder's own counts, :meth:`dloom.decode.decoders.Decoder.totals`, under ``"totals"``)."""
    if as_json:
        data = report.to_json(with_outputs=outputs)
        if totals is not None:
            data["totals"] = totals
        write_jsonl([data])
        return
    title = f"{report.config['strategy']} on {report.config['model']}"
    if not report.complete:
        title += f" (interrupted: {report.n} examples finished)"
    table = named_table("task", "accuracy", "n", names=list(report.per_task), title=title)
    for family, stats in report.per_task.items():
        table.add_row(family, f"{stats['accuracy']:.1%}", str(stats["n"]))
    table.add_row("all", f"{report.accuracy:.1%}", str(report.n), style="bold")
    console.print(table)
    console.print(f"NFE/example {report.nfe_mean:.2f}   TPF {report.tpf:.2f}   TPS {report.tps:.1f}")
    if report.speculation is not None:
        console.print(
            f"accepted drafts per verification {report.speculation['accepted_per_verification']:.2f}"
            f"   guarantee {report.speculation['guarantee']}"
        )
    if report.edits_per_answer is not None:
        console.print(
            f"edits/answer {report.edits_per_answer:.2f}   fixed a wrong draft {report.fixed_by_edit_share:.1%}"
            f"   broke a right draft {report.broken_by_edit_share:.1%}"
        )
    if totals is not None:
        console.print("   ".join(
            f"{name.replace('_', ' ')} {value:.2f}" if isinstance(value, float) else f"{name.replace('_', ' ')} {value}"
            for name, value in totals.items() if isinstance(value, (int, float))
        ))


def check_output(path: Path, force: bool) -> None:
    """Refuse an output path that cannot be written, before any work.

    :raises ConfigurationError: for a directory, a missing or unwritable parent, or an
        existing file without ``--force``.
    """
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ConfigurationError(f"-o {path} is a directory; allowed: a file path")
    if not parent.is_dir():
        raise ConfigurationError(f"-o {path}: directory {str(parent)!r} does not exist; create it first")
    if path.exists() and not force:
        raise ConfigurationError(f"-o {path} exists; pass --force to overwrite it")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigurationError(f"-o {path} is not writable")


@app.command()
def demo(
    model: str = ModelOption,
    n: int = typer.Option(21, "-n", help="Held-out examples (balanced over families)."),
    batch_size: int = typer.Option(32, min=1, help="Prompts per forward batch."),
    as_json: bool = JsonOption,
) -> None:
    """Decode task prompts with the baseline and every strategy; compare speed and outputs."""
    from dloom.decode.decoders import DIFFUSION
    from dloom.decode.transition import unsupported
    from dloom.evaluation import evaluate, select_examples
    from dloom.hooks.composition import compose
    from dloom.hooks.registry import get_registry

    baseline = DEFAULT_STRATEGY
    try:
        examples = select_examples("all", n)
        # the demo decodes one dLLM: strategies of another decoder (an AR target's) do not run here
        strategies = [s for s in get_registry().strategies.values() if s.registration.decoder == DIFFUSION]
        names = [baseline] + sorted(
            s.name for s in strategies if s.name != baseline and "dloom_select_commit" in s.hooks
        )
        # speculators run over the baseline and over the fastest approximate rule
        names += [
            f"{s.name}+{rule}" for s in sorted(strategies, key=lambda s: s.name)
            if "dloom_draft" in s.hooks for rule in (baseline, "threshold")
        ]
        reports, rules = {}, {}
        kernel = None  # the model's, learnt from the baseline's decoder
        for name in names:
            if kernel is not None and unsupported(compose(name), kernel) is not None:
                continue  # a strategy for another kind of model (an editing rule, say)
            try:
                decoder = build_decoder(model, name, [])
                kernel = kernel or decoder.model.kernel  # type: ignore[attr-defined]  # all dLLM decoders
                rules[name] = decoder.composition.provider("dloom_select_commit")
                with progress_bar(f"eval {decoder.name}", len(examples)) as on_batch:
                    reports[name] = evaluate(decoder, examples, batch_size=batch_size, on_batch=on_batch)
            except DloomError as error:
                if name == baseline:
                    raise
                err_console.print(f"[yellow]skipped[/] {escape(name)}: {escape(str(error))}", highlight=False)
        reports = {k: v for k, v in reports.items() if rules.get(k) in reports}
    except DloomError as error:
        fail(error)
    base = reports[baseline]

    def identical(report, other) -> float:
        return sum(a["text"] == b["text"] for a, b in zip(report.outputs, other.outputs)) / report.n

    rows: list[dict[str, Any]] = []
    for name, report in reports.items():
        rule = rules[name]  # a speculator's outputs must equal its commit rule's alone
        rows.append({
            "strategy": name, "accuracy": report.accuracy, "nfe_mean": report.nfe_mean,
            "tpf": report.tpf, "tps": report.tps,
            "nfe_ratio_vs_baseline": base.nfe_mean / report.nfe_mean if report.nfe_mean else 0.0,
            "identical_to_baseline": identical(report, base), "n": report.n,
            "identical_to_commit_rule": identical(report, reports[rule]) if rule is not None and rule != name else None,
        })
    if as_json:
        write_results(sys.stdout, json.dumps({"model": model or DEFAULT_MODEL, "baseline": baseline, "rows": rows}, indent=2) + "\n")
        return
    table = named_table(
        "strategy", "accuracy", "NFE", "TPF", "TPS", "fewer NFE", "identical to baseline",
        "identical to its rule", names=[row["strategy"] for row in rows],
        title=f"dloom demo: {n} held-out task prompts on {model or DEFAULT_MODEL} (baseline: {baseline}, one token per step)",
    )
    for row in rows:
        table.add_row(
            row["strategy"], f"{row['accuracy']:.0%}", f"{row['nfe_mean']:.1f}", f"{row['tpf']:.2f}",
            f"{row['tps']:.0f}", f"{row['nfe_ratio_vs_baseline']:.2f}x", f"{row['identical_to_baseline']:.0%}",
            "" if row["identical_to_commit_rule"] is None else f"{row['identical_to_commit_rule']:.0%}",
        )
    console.print(table)
    first = base.outputs[0]
    console.print(f"e.g. {first['prompt']!r} -> {first['text']!r}")


@app.command()
def plugins(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """List loaded plugins: name, version, hooks implemented, strategies registered."""
    from dloom.hooks.registry import get_registry

    try:
        registry = get_registry()
    except DloomError as error:
        fail(error)
    records: list[dict[str, Any]] = [
        {"name": p.name, "version": p.version, "builtin": p.builtin, "hooks": list(p.hooks),
         "strategies": list(p.strategies)}
        for p in registry.plugins.values()
    ]
    failures = [{"name": f.name, "error": f.error} for f in registry.failures]
    if as_json:
        write_results(sys.stdout, json.dumps({"plugins": records, "failures": failures}, indent=2) + "\n")
        return
    labels = [r["name"] + ("" if r["builtin"] else " (third party)") for r in records]
    table = named_table("plugin", "version", "hooks", "strategies", names=labels)
    for label, record in zip(labels, records):
        table.add_row(
            label, record["version"],
            ", ".join(record["hooks"]), ", ".join(record["strategies"]),
        )
    console.print(table)
    for failure in failures:
        err_console.print(
            f"[yellow]skipped[/] {escape(failure['name'])}: {escape(failure['error'])}",
            highlight=False,
        )


@app.command()
def strategies(
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    compose_spec: str | None = typer.Option(
        None, "--compose", metavar="SPEC",
        help="Show who answers each decoding hook in the composition SPEC (e.g. "
        "'spiffy+quota+myprune@prune': NAME@HOOK replaces that hook of the other strategies).",
    ),
) -> None:
    """List strategies: name, plugin, decoder, hooks, parameters with defaults, claim,
    guarantee. With --compose: one composition's hooks and their providers."""
    from dloom.hooks.composition import compose
    from dloom.hooks.registry import get_registry
    from dloom.types import Claim

    try:
        registry = get_registry()
        composition = compose(compose_spec, None, registry) if compose_spec else None
    except DloomError as error:
        fail(error)
    if composition is not None:
        hooks_table = composition.hook_table()
        if as_json:
            write_results(sys.stdout, json.dumps({"strategy": composition.name, "hooks": hooks_table}, indent=2) + "\n")
            return
        table = named_table("hook", "answered by", "replaces", names=list(hooks_table))
        for hook, row in hooks_table.items():
            default = "core default (keeps every draft)" if hook == "dloom_prune" else "-"
            table.add_row(hook, row["provider"] or default, ", ".join(row["replaces"]) or "-")
        console.print(table)
        return
    records: list[dict[str, Any]] = [
        {
            "name": s.name, "plugin": s.plugin, "summary": s.summary, "guarantee": s.guarantee,
            "claim": s.claim.to_json() if s.claim is not None else None,
            "decoder": s.registration.decoder,
            "hooks": list(s.hooks),
            "parameters": [
                {"name": p.name, "default": p.default, "type": p.kind.__name__,
                 "allowed": p.allowed(), "help": p.help}
                for p in s.parameters
            ],
        }
        for s in sorted(registry.strategies.values(), key=lambda s: s.name)
    ]
    if as_json:
        write_results(sys.stdout, json.dumps(records, indent=2) + "\n")
        return
    table = named_table(
        "strategy", "plugin", "parameters", "claim", "guarantee", names=[r["name"] for r in records]
    )
    for record in records:
        params = ", ".join(f"{p['name']}={p['default']} {p['allowed']}" for p in record["parameters"])
        claim = Claim(**record["claim"]).describe(conditions=False) if record["claim"] else "-"
        table.add_row(record["name"], record["plugin"], params or "-", claim, record["guarantee"])
    console.print(table)


# --- dloom check -------------------------------------------------------------------------


@app.command(cls=StrategyOptionsCommand)
def check(
    strategy: str = typer.Option(..., "--strategy", "-s", help="Strategy name(s), joined with '+'."),
    against: str | None = typer.Option(
        None, help="Reference strategy (or 'kernel'); default: the one the claim declares."
    ),
    model: str | None = typer.Option(
        None, "--model", "-m",
        help="Model of the greedy check (zoo name or directory; default toy-dllm, else a tiny random model).",
    ),
    param: list[str] = ParamOption,
    prompts_file: Path | None = typer.Option(
        None, "--prompts", help="JSONL prompts for the greedy check.", exists=True, dir_okay=False
    ),
    n: int = typer.Option(32, "-n", min=1, help="Prompts of the greedy check (default set)."),
    gen_length: int | None = typer.Option(None, help="Generated positions in the greedy check."),
    block_length: int | None = typer.Option(None, help="Block length in the greedy check."),
    temperature: float = typer.Option(1.0, help="Temperature of the sampling test (0: greedy only)."),
    samples: int = typer.Option(20_000, min=1, help="Samples per tiny model in the sampling test."),
    seeds: int = typer.Option(3, min=1, help="Tiny models (seeds) in the sampling test."),
    alpha: float = typer.Option(1e-3, help="Significance of the chi-square test."),
    epsilon: float = typer.Option(0.05, help="Total-variation distance the power is stated for."),
    as_json: bool = JsonOption,
) -> None:
    """Test the claim a strategy declares: lossless (greedy identity + exact sampling test),
    a bound (soundness on random and adversarial joints), or nothing to test.

    Exit status: 0 the claim holds or there is nothing to test, 1 refuted (not lossless,
    unsound) or a hook broke its contract (contract broken), 2 usage error, 3 inconclusive.
    """
    import time

    from dloom.check import check_strategy
    from dloom.check.progress import listen

    started = time.perf_counter()

    def show(stage: str) -> None:
        err_console.print(f"[dim]{time.perf_counter() - started:6.1f}s[/] {escape(stage)}", highlight=False)

    try:
        prompts = read_prompts(prompts_file) if prompts_file else None
        with listen(show):
            report = check_strategy(
                strategy, against, params=parse_params(param), model=model, prompts=prompts,
                temperature=temperature, samples=samples, seeds=seeds, alpha=alpha, epsilon=epsilon,
                prompt_count=n, gen_length=gen_length, block_length=block_length,
            )
    except DloomError as error:
        fail(error)
    if as_json:
        write_results(sys.stdout, json.dumps(report.to_json(), indent=2) + "\n")
    else:
        console.print(escape(report.render()), highlight=False)
    raise typer.Exit(code=report.exit_code)


from dloom.serve.command import serve as serve_command  # noqa: E402 - `dloom serve` lives with its server


@app.command(name="serve")
@functools.wraps(serve_command)
def serve(**options: Any) -> None:
    """``dloom serve`` (:func:`dloom.serve.command.serve`, its options and help), its errors printed."""
    try:
        serve_command(**options)
    except DloomError as error:
        fail(error)
