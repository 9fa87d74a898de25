"""The benchmark report: one run that measures every strategy and rewrites the docs' figures.

::

    python -m benchmarks.report --workers 2       # the published report: long-dllm-words, 300 prompts
    python -m benchmarks.report ... --resume      # the same report, stopped: measure what is left
    python -m benchmarks.report --model toy-dllm -n 140 --target none   # the toy report
    python -m benchmarks.report ... --micro       # plus the pytest-benchmark suite

The workload comes from the model: a tokenizer that writes every character of
:data:`dloom.zoo.long_tasks.ALPHABET` decodes the long-answer suite (``--tasks long``), any
other the toy suite (``--tasks all``); ``--tasks`` overrides it. In one process the report
decodes the same held-out prompts with every configuration of its matrix (the
one-token-per-step baseline first), grades them with :func:`dloom.evaluation.evaluate`, and
records accuracy, NFE, tokens per forward (TPF), tokens per second (TPS), hook time shares,
Spiffy's acceptance and the ratios against the baseline of the same run; and the distance to
the limit: the oracle NFE of the same prompts (:mod:`dloom.decode.oracle`), each configuration's NFE
÷ oracle, NFE per answer token, padding share and the most Spiffy could save over its rule.

Matrices (``--matrix``; ``auto``: ``full`` on the long suite, ``headline`` on the toy one):

* ``headline``: the toy report's configurations (:data:`report_measure.CONFIGS`), Spiffy with
  its built-in graphs;
* ``full``: quota, threshold 0.9, factor 1 and Fréchet at every δ of ``--deltas`` without a
  cache; Fréchet's δ chosen from that sweep at matched accuracy
  (:func:`report_targets.choose_delta`); quota, threshold, factor and the chosen Fréchet under
  every other cache of ``--caches``; Spiffy over each of those four under every cache, with
  graphs calibrated here on at least ``--calibration-paths`` paths of training-split prompts
  (:mod:`report_calibration`); and Spiffy under the last cache of ``--caches`` (default
  dual) with graphs of each ``--calibration-sizes`` against its rule alone.

With ``--target`` (and ``--assistant``), FailFast with this dLLM as drafter (at each of
``--drafter-taus``, the drafter's commit thresholds) against AR
decoding and assisted generation (:mod:`report_failfast`); for a zoo dLLM they default to its
zoo partners (:func:`zoo_partners`: ``long-dllm-words`` drafts for ``long-dllm-words-ar``,
assisted generation drafts with ``long-dllm-words-ar-small``; ``long-dllm`` drafts for
``long-ar``, with ``long-ar-small``), and ``none`` leaves them out. Every run ends with issue 19's
targets as a checklist computed from its rows (:func:`report_targets.checklist`).

It writes (``DOCS`` is ``--docs``, default ``docs/``):

* ``--out`` (default ``benchmarks/results/report.json``): every figure, machine-readable;
* ``DOCS/benchmarks/report.md``: the generated tables (never edit it by hand);
* ``DOCS/assets/report-accuracy-nfe.png``, ``report-speedup.png``, ``report-acceptance.png``
  and, with the full matrix, ``report-calibration.png``;
* the headline table between ``<!-- report:headline:start -->`` and
  ``<!-- report:headline:end -->`` in ``--readme`` and ``DOCS/index.md``;
* with ``--micro``: the pytest-benchmark suite ``benchmarks/test_bench_strategies.py``, its
  JSON at ``--micro-json`` (default ``benchmarks/results/pytest-benchmark.json``) and its
  table in the report page.

Every finished measurement is appended at once to ``--out`` with the suffix
``.measurements.jsonl`` (:mod:`report_store`); after an interrupt, ``--resume`` with the same
options reuses each one whose model weights, prompts, settings and graph files are unchanged,
and measures the rest (the JSON lists the reused ones under ``reused``).

Every ratio compares two configurations measured on this machine, in this run or, after
``--resume``, in the stopped run that measured one of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.report_failfast import check_models
from benchmarks.report_jobs import Context, Job, Runner, calibration_job, row_job
from benchmarks.report_measure import (
    BASELINE,
    CACHES,
    CONFIGS,
    DELTAS,
    Config,
    base_rules,
    cached,
    compare,
    drop_texts,
    frechet,
    registered_config,
    same_outputs,
    spiffy_over,
)
from benchmarks.report_plots import (
    plot_acceptance,
    plot_accuracy_nfe,
    plot_calibration,
    plot_speedup,
)
from benchmarks.report_store import MeasurementStore, run_identity
from benchmarks.report_tables import (  # noqa: F401  (headline_table, oracle_table, micro_table: the tests' API)
    CALIBRATION_PLOT,
    PLOTS,
    headline_table,
    micro_table,
    oracle_table,
    replace_marked,
    report_page,
)
from benchmarks.report_targets import checklist, choose_delta
from dloom import DiffusionDecoder, load_model
from dloom.errors import ConfigurationError, DloomError, ModelError
from dloom.evaluation import SUITES, select_examples, workload_suite

ROOT = Path(__file__).resolve().parents[1]
MATRICES = ("auto", "headline", "full")
STORE_SUFFIX = ".measurements.jsonl"
"""The suffix (on ``--out``) of the file of finished measurements (:mod:`report_store`)."""
CALIBRATION_SIZES = (25, 100, 250)
"""Calibration sizes (paths) Spiffy is measured at next to its main graph's."""


DEFAULT_MODEL = "long-dllm-words"
"""The report's dLLM by default: the long-answer workload's in word tokens, which decodes
several tokens a forward at Fast-dLLM's threshold 0.9 without losing accuracy (issue 42)."""
DEFAULT_N = 300
"""Held-out prompts by default."""
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "report.json"
"""Where the report's figures are written by default (the published report's are in
``report-words.json``, so its command names ``--out``)."""
DEFAULT_BATCH_SIZE = 32
"""Prompts decoded together by default."""


DRAFTER_TAUS = (0.05, 0.9)
"""The drafter commit thresholds FailFast is measured at by default: the paper's 0.05, and
Fast-dLLM's threshold 0.9."""


@dataclass
class Settings:
    """What the full matrix, the calibration and FailFast take (``main``'s options)."""

    tasks: str = "auto"
    matrix: str = "auto"
    deltas: tuple[float, ...] = DELTAS
    caches: tuple[str, ...] = CACHES
    calibration_paths: int = 500
    calibration_sizes: tuple[int, ...] = CALIBRATION_SIZES
    calibration_min_prompts: int = 32
    calibration_seed: int = 0
    spiffy_budget: int = 10
    graphs: Path = field(default_factory=lambda: ROOT / "benchmarks" / "results" / "graphs")
    target: str | None = None
    assistant: str | None = None
    drafter_taus: tuple[float, ...] = DRAFTER_TAUS
    device: str = "cpu"
    store: Path | None = None
    resume: bool = False
    workers: int = 1


def workload_tasks(model) -> str:
    """The suite ``model`` is benchmarked on (:func:`dloom.evaluation.workload_suite`).

    :raises ConfigurationError: for a model without a tokenizer or one that writes neither.
    """
    suite = workload_suite(model.tokenizer)
    if suite is None:
        raise ConfigurationError(
            f"model {model.name!r}'s tokenizer writes neither the toy suite's nor the long suite's "
            "characters; allowed: a zoo-style character tokenizer, or --tasks all|long"
        )
    return suite


def zoo_partners(model: str) -> tuple[str | None, str | None]:
    """The zoo's AR target and small AR assistant for the zoo dLLM ``model``
    (:data:`dloom.zoo.PARTNERS`; ``long-dllm``: ``long-ar`` and ``long-ar-small``); ``None``
    for a role the zoo has no model for, and both for any other model."""
    from dloom.zoo import PARTNERS

    return PARTNERS.get(model, (None, None))


def partner_defaults(model: str, target: str | None) -> tuple[str, str]:
    """``(--target, --assistant's default)`` for ``model`` and the ``--target`` given (``None``:
    not given): the given target or the zoo's (:func:`zoo_partners`), and the zoo's assistant
    only with the zoo's target; ``"none"`` for a role without a model."""
    zoo_target, zoo_assistant = zoo_partners(model)
    target = target or zoo_target or "none"
    return target, (zoo_assistant if target == zoo_target else None) or "none"


def run_full(runner: Runner, settings: Settings, model_name: str, common: Sequence[Job]) -> dict[str, Any]:
    """The full matrix, in three stages of jobs whose inputs are known (each stage's jobs run
    at once with ``--workers``):

    1. every rule without a cache (Fréchet at every δ), the graphs of quota, threshold and
       factor, and ``common`` (the oracle, FailFast);
    2. Fréchet's δ chosen from the sweep; the graphs of that Fréchet, the four rules under the
       other caches, and Spiffy over quota, threshold and factor (every cache, and against
       calibration size under the last cache);
    3. Spiffy over the chosen Fréchet.

    ``{"rows", "frechet_choice", "calibration", "common"}`` (``common``: those jobs'
    results); the rows keep their texts."""
    context = runner.context
    sizes = sorted({*settings.calibration_sizes, settings.calibration_paths})
    description = {"tasks": context.tasks, "split": "train", "seed": settings.calibration_seed}
    out = settings.graphs / Path(model_name).name
    graphs_of = lambda rule: calibration_job(rule, sizes, out, description, context)
    # Spiffy against calibration size runs under the last cache (default dual): there a
    # verification forward reads the block's columns only; without a cache every draft
    # is a whole sequence, which on a CPU costs the nodes' rows in compute.
    curve_cache = settings.caches[-1]

    def spiffy_jobs(rule: Config, records: list[dict[str, Any]]) -> list[Job]:
        main = [row_job(cached(spiffy_over(rule, records[-1]["graph"]), cache)) for cache in settings.caches]
        smaller = [cached(spiffy_over(rule, r["graph"]), curve_cache) for r in records[:-1]]
        return main + [row_job(dataclasses.replace(config, name=f"{config.name} ({r['paths']} paths)"))
                       for config, r in zip(smaller, records)]

    sweep_rules = base_rules(settings.deltas)
    first = runner.run([*map(row_job, sweep_rules), *map(graphs_of, CONFIGS[:3]), *common])
    rows = first[:len(sweep_rules)]
    records = dict(zip((c.name for c in CONFIGS[:3]), first[len(sweep_rules):len(sweep_rules) + 3]))
    plain = {row["name"]: row for row in rows}
    sweep = [row for row in rows if row["commit_rule"] == "frechet"]
    choice = choose_delta(plain["threshold"], sweep)
    # No δ matched: Spiffy goes over the most accurate one (ties: the smaller δ).
    delta = choice["delta"] if choice["delta"] is not None else max(
        sweep, key=lambda r: (r["accuracy"], -r["delta"]))["delta"]
    rules = (*CONFIGS[:3], frechet(delta))
    for rule in rules:
        plain[rule.name]["headline"] = True

    cached_jobs = [row_job(cached(rule, cache)) for cache in settings.caches[1:] for rule in rules]
    spiffy = [spiffy_jobs(rule, records[rule.name]) for rule in CONFIGS[:3]]
    second = runner.run([*cached_jobs, graphs_of(rules[3]), *(job for jobs in spiffy for job in jobs)])
    rows += second[:len(cached_jobs)]
    records[rules[3].name] = second[len(cached_jobs)]
    spiffy_rows, at = [], len(cached_jobs) + 1
    for jobs in spiffy:
        spiffy_rows.append(second[at:at + len(jobs)])
        at += len(jobs)
    spiffy.append(spiffy_jobs(rules[3], records[rules[3].name]))
    spiffy_rows.append(runner.run(spiffy[3]))

    graphs: dict[str, dict[str, Any]] = {}
    curve: list[dict[str, Any]] = []
    for rule, measured_rows in zip(rules, spiffy_rows):
        graphs[rule.name] = records[rule.name][-1]
        main, smaller = measured_rows[:len(settings.caches)], measured_rows[len(settings.caches):]
        for row, cache in zip(main, settings.caches):
            row["headline"] = cache == "none" or (cache == "dual" and rule.strategy == "frechet")
        rows += main
        by_name = {row["name"]: row for row in rows}
        alone = by_name[cached(rule, curve_cache).name]
        for record, row in zip(records[rule.name], [*smaller, main[settings.caches.index(curve_cache)]]):
            curve.append({
                "rule": rule.name, "target_paths": record["target_paths"], "paths": record["paths"],
                "prompts": record["prompts"], "nfe_mean": row["nfe_mean"],
                "nfe_ratio": alone["nfe_mean"] / row["nfe_mean"], "identical_to_commit_rule": same_outputs(row, alone),
            })
    calibration = {
        "tasks": context.tasks, "seed": settings.calibration_seed, "paths": settings.calibration_paths,
        "min_prompts": settings.calibration_min_prompts, "budget": settings.spiffy_budget,
        "graphs": graphs, "curve": curve, "curve_cache": curve_cache,
    }
    return {"rows": rows, "frechet_choice": choice, "calibration": calibration,
            "common": first[len(sweep_rules) + 3:]}


def run(
    model_name: str, n: int, batch_size: int, configs: Sequence[Config], command: str,
    settings: Settings | None = None,
) -> dict[str, Any]:
    """Measure the matrix on the same ``n`` held-out prompts; the report's JSON object
    (``command`` is recorded as the way to reproduce it; ``configs``: the headline matrix's)."""
    settings = settings or Settings()
    started = time.perf_counter()
    model = load_model(model_name, device=settings.device)
    tasks = workload_tasks(model) if settings.tasks == "auto" else settings.tasks
    matrix = settings.matrix if settings.matrix != "auto" else ("full" if tasks == "long" else "headline")
    if matrix == "full" and len(configs) != len(CONFIGS):
        raise ConfigurationError("--configs picks configurations of the headline matrix; the full matrix "
                                 "takes --deltas, --caches and --calibration-* instead")
    if settings.target is not None:
        check_models(model, settings.target, settings.assistant)
    examples = select_examples(tasks, n)
    # Warm up (lazy initialisation, allocator) so that the first configuration's TPS is fair.
    DiffusionDecoder(model, BASELINE.strategy).generate([e.prompt for e in examples[:2]])
    store = MeasurementStore(settings.store, run_identity(model, examples, batch_size), settings.resume)
    context = Context(model, examples, tasks, batch_size, settings.spiffy_budget, settings.calibration_min_prompts,
                      settings.calibration_seed)
    common = [Job("oracle", "oracle")]
    if settings.target is not None:
        common.append(Job("failfast", "failfast", {"target": settings.target, "assistant": settings.assistant,
                                                   "drafter_taus": list(settings.drafter_taus)}))
    runner = Runner(store, context, settings.workers, model_name, settings.device)
    try:
        if matrix == "full":
            measured_matrix = run_full(runner, settings, model_name, common)
        else:
            results = runner.run([*map(row_job, configs), *common])
            measured_matrix = {"rows": results[:len(configs)], "frechet_choice": None, "calibration": None,
                               "common": results[len(configs):]}
    finally:
        runner.close()
    rows = measured_matrix["rows"]
    oracle, failfast = (*measured_matrix["common"], None)[:2]
    print(f"{'oracle':26s} NFE {oracle['nfe_mean']:7.2f}  reached {oracle['reached_share']:6.1%}",
          file=sys.stderr, flush=True)
    compare(rows, oracle)
    drop_texts(rows)
    sample = DiffusionDecoder(model, BASELINE.strategy).config
    report = {
        "command": command,
        "date": datetime.date.today().isoformat(),
        "model": model_name,
        "tasks": tasks,
        "matrix": matrix,
        "n": n,
        "batch_size": batch_size,
        "gen_length": sample["gen_length"],
        "block_length": sample["block_length"],
        "temperature": sample["temperature"],
        "dtype": sample["dtype"],
        "device": sample["device"],
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "baseline": BASELINE.name,
        "oracle": {key: oracle[key] for key in ("nfe_mean", "reached_share")},
        "rows": rows,
        "frechet_choice": measured_matrix["frechet_choice"],
        "calibration": measured_matrix["calibration"],
        "failfast": failfast,
        "reused": store.reused,
    }
    report["targets"] = checklist(report)
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


# --- the command -----------------------------------------------------------------------


def run_micro(path: Path) -> None:
    """Run the pytest-benchmark suite, saving its JSON at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pytest", str(ROOT / "benchmarks" / "test_bench_strategies.py"), "-q",
         "-p", "no:cacheprovider", f"--benchmark-json={path}"],
        cwd=ROOT, check=True,
    )


def write(report: dict[str, Any], out: Path, docs: Path, readme: Path, micro: Path | None) -> list[Path]:
    """Write the page, the plots and the two headline tables; return what was written."""
    assets = docs / "assets"
    assets.mkdir(parents=True, exist_ok=True)
    (docs / "benchmarks").mkdir(parents=True, exist_ok=True)
    plots = {key: assets / name for key, name in PLOTS.items()}
    plot_accuracy_nfe(report, plots["accuracy_nfe"])
    plot_speedup(report, plots["speedup"])
    plot_acceptance(report, plots["acceptance"])
    written = list(plots.values())
    if report.get("calibration") and report["calibration"]["curve"]:
        plot_calibration(report, assets / CALIBRATION_PLOT)
        written.append(assets / CALIBRATION_PLOT)
    page = docs / "benchmarks" / "report.md"
    page.write_text(report_page(report, out, micro))
    headline = headline_table(report)
    for target in (readme, docs / "index.md"):
        target.write_text(replace_marked(target.read_text(), "headline", headline))
    return [page, *written, readme, docs / "index.md"]


def numbers(kind: type, text: str) -> tuple[Any, ...]:
    return tuple(kind(part) for part in text.split(",") if part.strip())


def shown_path(path: Path) -> str:
    """``path`` as the recorded command writes it: relative to the repository when inside it."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def options(args: argparse.Namespace, defaults: Settings) -> list[str]:
    """The options of ``args`` (as :func:`parse_settings` resolved them) that differ from their
    defaults, as the recorded command writes them."""
    shown = []
    for flag, value, default in (
        ("--model", args.model, DEFAULT_MODEL), ("-n", args.n, None), ("--tasks", args.tasks, defaults.tasks),
        ("--matrix", args.matrix, defaults.matrix), ("--configs", args.configs, "all"),
        ("--deltas", args.deltas, ",".join(f"{d:g}" for d in defaults.deltas)),
        ("--caches", args.caches, ",".join(defaults.caches)),
        ("--calibration-paths", args.calibration_paths, defaults.calibration_paths),
        ("--calibration-sizes", args.calibration_sizes, ",".join(map(str, defaults.calibration_sizes))),
        ("--calibration-min-prompts", args.calibration_min_prompts, defaults.calibration_min_prompts),
        ("--spiffy-budget", args.spiffy_budget, defaults.spiffy_budget),
        ("--target", args.target, partner_defaults(args.model, None)[0]),
        ("--assistant", args.assistant, partner_defaults(args.model, args.target)[1]),
        ("--drafter-taus", args.drafter_taus, ",".join(map(repr, defaults.drafter_taus))),
        ("--device", args.device, defaults.device), ("--workers", args.workers, defaults.workers),
        ("--batch-size", args.batch_size, DEFAULT_BATCH_SIZE), ("--threads", args.threads, 1),
        ("--out", shown_path(args.out), shown_path(DEFAULT_OUT)),
    ):
        if value != default:
            shown.append(f"{flag} {value}")
    return shown


def main(argv: Sequence[str] | None = None) -> None:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="zoo name or checkpoint directory (with a tokenizer)")
    parser.add_argument("-n", type=int, default=DEFAULT_N, help="held-out prompts, balanced over the task families")
    parser.add_argument("--tasks", default="auto", choices=("auto", *SUITES),
                        help="task suite (auto: the one the model's tokenizer writes)")
    parser.add_argument("--matrix", default="auto", choices=MATRICES,
                        help="configurations: headline (the toy report's) or full (auto: full on the long suite)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steady CPU timings)")
    parser.add_argument("--configs", default="all", help="headline matrix: comma-separated configuration names "
                        f"(the baseline always runs): {', '.join(c.name for c in CONFIGS)}, or any "
                        "registered strategy or composition (at its defaults, no cache)")
    parser.add_argument("--deltas", default=",".join(f"{d:g}" for d in defaults.deltas),
                        help="full matrix: Fréchet's δ grid, each in [0, 1)")
    parser.add_argument("--caches", default=",".join(defaults.caches), help="full matrix: cache modes, none first")
    parser.add_argument("--calibration-paths", type=int, default=defaults.calibration_paths,
                        help="full matrix: fewest calibration paths of each rule's draft graph")
    parser.add_argument("--calibration-sizes", default=",".join(map(str, defaults.calibration_sizes)),
                        help="full matrix: smaller calibration sizes (paths) Spiffy is also measured at")
    parser.add_argument("--calibration-min-prompts", type=int, default=defaults.calibration_min_prompts,
                        help="full matrix: fewest training prompts of each main draft graph")
    parser.add_argument("--spiffy-budget", type=int, default=defaults.spiffy_budget,
                        help="full matrix: nodes of each calibrated draft graph (Spiffy's drafts per verification)")
    parser.add_argument("--graphs", type=Path, default=defaults.graphs, help="where calibrated graphs are written")
    parser.add_argument("--target", default=None, help="AR target for FailFast (this dLLM drafts); 'none': no "
                        "FailFast (default: the zoo's target for a zoo dLLM, none for other models)")
    parser.add_argument("--assistant", default=None, help="small AR assistant for assisted generation; 'none': "
                        "without it (default: the zoo's for a zoo dLLM with its --target, none otherwise)")
    parser.add_argument("--drafter-taus", default=",".join(map(repr, defaults.drafter_taus)),
                        help="FailFast (with --target): the drafter commit thresholds it is measured at, "
                        "each in (0, 1)")
    parser.add_argument("--device", default="cpu", help="where every model runs (e.g. cuda)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--workers", type=int, default=1,
                        help="processes the measurements of a stage run in at once, each with its own copy of "
                        "the model and --threads threads (1: one after another in this process)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the measurements a stopped run of this report kept (OUT with the suffix "
                        f"{STORE_SUFFIX}: every finished measurement is written there at once)")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs", help="docs directory to write into")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--micro", action="store_true", help="also run the pytest-benchmark suite")
    parser.add_argument("--micro-json", type=Path,
                        default=ROOT / "benchmarks" / "results" / "pytest-benchmark.json")
    args = parser.parse_args(argv)
    settings = parse_settings(parser, args)
    torch.set_num_threads(args.threads)
    wanted = None if args.configs == "all" else list(dict.fromkeys(args.configs.split(",")))
    known = {c.name for c in CONFIGS}
    registered = []  # any other registered strategy, at its defaults
    for name in [n for n in wanted or [] if n not in known]:
        try:
            registered.append(registered_config(name))
        except DloomError as error:
            parser.error(f"unknown configuration {name!r}: neither one of the report's "
                         f"({', '.join(sorted(known))}) nor a registered strategy ({error})")
    if wanted is not None and settings.matrix == "full":
        parser.error("--configs picks configurations of the headline matrix; the full matrix takes "
                     "--deltas, --caches and --calibration-* instead")
    configs = [c for c in CONFIGS if c is BASELINE or wanted is None or c.name in wanted] + registered
    command = " ".join(["python -m benchmarks.report", *options(args, defaults)]
                       + (["--micro"] if args.micro else []))
    try:
        report = run(args.model, args.n, args.batch_size, configs, command, settings)
    except (ConfigurationError, ModelError) as error:  # bad models or suite: named, no traceback
        parser.exit(2, f"report.py: error: {error}\n")
    if args.micro:
        run_micro(args.micro_json)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    written = write(report, args.out, args.docs, args.readme, args.micro_json if args.micro else None)
    for path in [args.out, *written]:
        print(f"wrote {path}", file=sys.stderr)


def parse_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Settings:
    """The :class:`Settings` of ``args``, refused (``parser.error``) before any work when bad;
    ``args.target`` and ``args.assistant`` are resolved (:func:`partner_defaults`)."""
    explicit_assistant = args.assistant is not None
    args.target, default_assistant = partner_defaults(args.model, args.target)
    args.assistant = args.assistant or default_assistant
    target = None if args.target == "none" else args.target
    assistant = None if args.assistant == "none" else args.assistant
    try:
        deltas = numbers(float, args.deltas)
        sizes = numbers(int, args.calibration_sizes)
        drafter_taus = numbers(float, args.drafter_taus)
    except ValueError as error:
        parser.error(f"--deltas, --calibration-sizes and --drafter-taus take comma-separated numbers: {error}")
    if not drafter_taus or any(not 0 < t < 1 for t in drafter_taus) or len(set(drafter_taus)) < len(drafter_taus):
        parser.error(f"--drafter-taus {args.drafter_taus!r}: distinct thresholds, each in (0, 1) "
                     "(FailFast's drafter_tau)")
    args.drafter_taus = ",".join(map(repr, drafter_taus))  # the recorded command, as parsed
    if target is None and drafter_taus != DRAFTER_TAUS:
        parser.error("--drafter-taus needs --target (they are FailFast's)")
    caches = tuple(c.strip() for c in args.caches.split(",") if c.strip())
    bad_delta = [d for d in deltas if not 0 <= d < 1]
    if not deltas or bad_delta:
        parser.error(f"--deltas {args.deltas!r}: each δ must lie in [0, 1)")
    if not caches or caches[0] != "none" or set(caches) - set(CACHES) or len(set(caches)) < len(caches):
        parser.error(f"--caches {args.caches!r}: distinct modes of {', '.join(CACHES)}, 'none' first")
    if args.calibration_paths < 1 or args.calibration_min_prompts < 1:
        parser.error("--calibration-paths and --calibration-min-prompts must be >= 1")
    if any(not 1 <= size <= args.calibration_paths for size in sizes):
        parser.error(f"--calibration-sizes {args.calibration_sizes!r}: each in 1 .. --calibration-paths "
                     f"({args.calibration_paths})")
    if args.spiffy_budget < 1:
        parser.error(f"--spiffy-budget {args.spiffy_budget}: allowed: 1 or more nodes")
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: allowed: 1 or more processes")
    if explicit_assistant and assistant is not None and target is None:
        parser.error("--assistant needs --target (assisted generation is FailFast's comparison)")
    return Settings(
        tasks=args.tasks, matrix=args.matrix, deltas=deltas, caches=caches, calibration_paths=args.calibration_paths,
        calibration_sizes=sizes, calibration_min_prompts=args.calibration_min_prompts, graphs=args.graphs,
        spiffy_budget=args.spiffy_budget,
        target=target, assistant=assistant, drafter_taus=drafter_taus, device=args.device,
        store=args.out.with_suffix(STORE_SUFFIX), resume=args.resume, workers=args.workers,
    )


if __name__ == "__main__":
    main()
