"""Batch decoding of a prompt dataset with Ray Data, resumable through result shards.

The driver turns the prompts into a Ray dataset of ``(index, prompt)`` rows and maps
:class:`DecodeActor` over it with ``map_batches``: a pool of ``actors`` actors, each of
which builds one decoder (one model replica, on its own GPU when ``gpus_per_actor`` is 1)
and decodes the batches it is handed. Every decoded batch becomes one shard file
``rows-<first>-<last>.jsonl`` in ``output_dir`` (written to a temporary name, then renamed,
so a shard is either whole or absent); a rerun with the same ``output_dir`` decodes only the
prompts no shard holds. The driver creates ``output_dir`` and checks that it can write there
before Ray starts; what goes wrong with the directory then (a file in its place, no
permission, a corrupt ``spec.json`` or shard) and a shard an actor cannot write later are
each one :class:`~dloom.errors.OutputError` or :class:`~dloom.errors.ConfigurationError`
naming the path, never a Ray traceback.

Each result row is what ``dloom generate --json`` prints for the prompt
(:meth:`dloom.metrics.GenerationResult.row`) plus its ``index`` in the request, the
``prompt`` and ``seconds``, its share of its batch's wall time; the first row of each
decoded batch also carries ``batch``: the batch's ``rows``, ``wall_seconds``,
``hook_seconds`` and ``speculation`` summary, counted once. Decoding in dloom is
batch-invariant (greedy, and sampled too: prompt ``i`` of a request draws from random stream
``i`` of the seed), so the rows equal those of decoding the request in one process, whatever
the batching, the number of actors or the point at which a run was resumed.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dloom import errors
from dloom.errors import ConfigurationError, DloomError, OutputError
from dloom.hooks.registry import DEFAULT_STRATEGY

Prompt = str | list[int]
SHARD_GLOB = "rows-*.jsonl"
SPEC_FILE = "spec.json"


@dataclass(frozen=True)
class DecodeSpec:
    """What each actor needs to build its decoder, as ``dloom generate`` takes it.

    :ivar model: a zoo name or a checkpoint directory readable by every actor (``None``:
        the command line's default, ``toy-dllm``; FailFast takes ``target`` and ``drafter``).
    :ivar strategy: a strategy spec (``"threshold"``, ``"spiffy+quota"``, ``"failfast"``).
    :ivar params: strategy parameters as ``NAME=VALUE`` strings (``"tau=0.9"``).
    :ivar settings: decoder settings by keyword (``gen_length``, ``block_length``, ``steps``,
        ``temperature``, ``remasking``, ``seed``, ``cache``, ``cache_refresh``).
    :ivar device: ``"cpu"``, ``"cuda"`` (each actor's own GPU) or another torch device.
    :ivar dtype: the model's dtype name.
    :ivar target: FailFast's AR target (``None``: its default).
    :ivar drafter: FailFast's dLLM drafter (``None``: its default).
    """

    model: str | None = None
    strategy: str = DEFAULT_STRATEGY
    params: tuple[str, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    dtype: str = "float32"
    target: str | None = None
    drafter: str | None = None

    def build(self):
        """The decoder this spec describes (:func:`dloom.factory.build_decoder`, the command line's builder)."""
        from dloom.factory import build_decoder

        return build_decoder(
            self.model, self.strategy, list(self.params), device=self.device, dtype=self.dtype,
            target=self.target, drafter=self.drafter, **self.settings,
        )


class DecodeActor:
    """One model replica in the actor pool: decodes a batch of rows and writes its shard.

    :param spec: the decoder to build, once, in the actor.
    :param output_dir: where shards go (``None``: results are only returned).
    :param threads: torch threads of this actor (its CPU share).
    """

    def __init__(self, spec: DecodeSpec, output_dir: str | None, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.output_dir = output_dir
        # Ray hands the driver only the text of what an actor raised: a dloom error is
        # returned as a record instead, and the driver raises it as itself.
        self.build_error: DloomError | None = None
        try:
            self.decoder = spec.build()
        except DloomError as error:
            self.build_error = error

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``batch``: columns ``index`` (ints) and ``prompt`` (JSON-encoded prompts).
        Returns the column ``row``: one JSON-encoded result row per prompt, or a single
        ``{"error": {"type", "message"}}`` record for a dloom error (nothing is written)."""
        order = sorted(range(len(batch["index"])), key=lambda i: int(batch["index"][i]))
        indices = [int(batch["index"][i]) for i in order]
        prompts = [json.loads(batch["prompt"][i]) for i in order]
        rows: list[dict[str, Any]] = []
        try:
            if self.build_error is not None:
                raise self.build_error
            for start, end in contiguous_runs(indices):
                # Prompt i samples from random stream i (row_offset): the same numbers as
                # decoding it in one process, whichever batch Ray put it in.
                result = self.decoder.generate(prompts[start:end], row_offset=indices[start])
                share = result.wall_seconds / (end - start)
                decoded = [
                    {"index": indices[start + i], "prompt": prompts[start + i], **result.row(i), "seconds": share}
                    for i in range(end - start)
                ]
                decoded[0]["batch"] = {
                    "rows": end - start, "wall_seconds": result.wall_seconds,
                    "hook_seconds": dict(result.hook_seconds), "speculation": result.speculation,
                }
                rows += decoded
            if self.output_dir is not None:
                write_shard(Path(self.output_dir), rows)
        except DloomError as error:
            record = {"type": type(error).__name__, "message": str(error)}
            return {"row": [json.dumps({"error": record})]}
        return {"row": [json.dumps(row) for row in rows]}


def contiguous_runs(indices: list[int]) -> list[tuple[int, int]]:
    """``(start, end)`` slices of sorted ``indices`` whose values are consecutive."""
    runs, start = [], 0
    for i in range(1, len(indices) + 1):
        if i == len(indices) or indices[i] != indices[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs


WRITABLE = "allowed: a directory this process can create and write into"


def write_shard(output_dir: Path, rows: list[dict[str, Any]]) -> Path:
    """Write ``rows`` as one JSONL shard, atomically (temporary file, then rename).

    :raises OutputError: naming the directory and the system's reason (the shards written
        before are kept; a rerun resumes from them).
    """
    first, last = min(r["index"] for r in rows), max(r["index"] for r in rows)
    path = output_dir / f"rows-{first:08d}-{last:08d}.jsonl"
    temporary = None
    try:
        handle, temporary = tempfile.mkstemp(dir=output_dir, prefix=".rows-", suffix=".tmp")
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            for row in sorted(rows, key=lambda r: r["index"]):
                stream.write(json.dumps(row) + "\n")
        os.replace(temporary, path)
    except OSError as error:
        if temporary is not None and os.path.lexists(temporary):
            os.unlink(temporary)
        raise OutputError(
            f"cannot write shard {path.name} into output_dir {str(output_dir)!r}: "
            f"{error.strerror or error}; {WRITABLE} (the shards written before are kept: "
            "rerun to resume)"
        ) from None
    return path


def prepare_output_dir(output_dir: Path) -> None:
    """Create ``output_dir`` (and its parents) and check that a file can be written in it,
    before any prompt is decoded.

    :raises OutputError: naming the directory: a file in its place (or in place of a parent),
        no permission, a read-only file system.
    """
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(dir=output_dir, prefix=".probe-", suffix=".tmp")
        os.close(handle)
        os.unlink(probe)
    except FileExistsError:
        raise OutputError(f"output_dir {str(output_dir)!r} is a file, not a directory; {WRITABLE}") from None
    except NotADirectoryError:
        raise OutputError(
            f"output_dir {str(output_dir)!r} lies under a file, not a directory; {WRITABLE}"
        ) from None
    except OSError as error:
        raise OutputError(
            f"cannot write into output_dir {str(output_dir)!r}: {error.strerror or error}; {WRITABLE}"
        ) from None


def _read_text(path: Path, what: str) -> str:
    """The text of ``path``, a file dloom wrote into an output directory.

    :raises ConfigurationError: naming the file, when it cannot be read as UTF-8 text (a
        directory in its place, no permission, binary data).
    """
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise ConfigurationError(
            f"{str(path)!r} cannot be read as {what}: {reason}; allowed: the file a dloom run "
            "wrote there (remove it, or use a new output directory)"
        ) from None


def read_shards(output_dir: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """Every result row the shards in ``output_dir`` hold, by request index.

    :raises ConfigurationError: for a shard that is not JSONL of result rows.
    """
    rows: dict[int, dict[str, Any]] = {}
    for path in sorted(Path(output_dir).glob(SHARD_GLOB)):
        for number, line in enumerate(_read_text(path, "a shard of result rows").splitlines(), 1):
            try:
                row = json.loads(line)
                rows[int(row["index"])] = row
            except (ValueError, KeyError, TypeError) as error:
                raise ConfigurationError(
                    f"{path}:{number} is not a dloom result row ({error}); remove the shard "
                    "to decode its prompts again"
                ) from error
    return rows


def _check_request(prompts: Sequence[Prompt], actors: int, batch_size: int, gpus_per_actor: float) -> None:
    if isinstance(prompts, str):
        raise ConfigurationError("prompts is one string; pass a list of prompts")
    if not prompts:
        raise ConfigurationError("no prompts to decode")
    kinds = {isinstance(p, str) for p in prompts}
    if len(kinds) > 1:
        raise ConfigurationError("the prompts mix texts and input_ids; use one kind")
    if actors < 1:
        raise ConfigurationError(f"actors is {actors}; allowed: >= 1")
    if batch_size < 1:
        raise ConfigurationError(f"batch_size is {batch_size}; allowed: >= 1")
    if gpus_per_actor < 0:
        raise ConfigurationError(f"gpus_per_actor is {gpus_per_actor}; allowed: >= 0")


def _resumable_rows(output_dir: Path, prompts: Sequence[Prompt], spec: DecodeSpec) -> dict[int, dict[str, Any]]:
    """The finished rows of an earlier run of the same request in ``output_dir`` (none for a
    new directory, which is created and stamped with ``spec``).

    :raises OutputError: when the directory cannot be created or written (:func:`prepare_output_dir`).
    :raises ConfigurationError: when the directory holds another decoder's or another
        request's rows, or a ``spec.json`` or shard that is not dloom's.
    """
    prepare_output_dir(output_dir)
    stamp = output_dir / SPEC_FILE
    if os.path.lexists(stamp):
        text = _read_text(stamp, "the spec.json of a dloom run")
        try:
            recorded = json.loads(text)
        except ValueError as error:
            raise ConfigurationError(
                f"{str(stamp)!r} is not the spec.json of a dloom run ({error}); allowed: the "
                "file a dloom run wrote there (remove it, or use a new output directory)"
            ) from None
        if recorded != json.loads(json.dumps(asdict(spec))):
            raise ConfigurationError(
                f"{output_dir} holds rows of another decoder ({recorded}); use a new "
                "output directory or the same settings"
            )
    else:
        try:
            stamp.write_text(json.dumps(asdict(spec), indent=2) + "\n", encoding="utf-8")
        except OSError as error:
            raise OutputError(f"cannot write {str(stamp)!r}: {error.strerror or error}; {WRITABLE}") from None
    done = read_shards(output_dir)
    for index, row in done.items():
        if index >= len(prompts) or row.get("prompt") != prompts[index]:
            raise ConfigurationError(
                f"{output_dir} holds a row for prompt {index} that is not this request's "
                f"prompt {index}; use a new output directory for a new request"
            )
    return done


def _raise_actor_error(record: dict[str, str]) -> None:
    """Raise the dloom error an actor returned, as its own class."""
    cls = getattr(errors, record["type"], None)
    if not (isinstance(cls, type) and issubclass(cls, DloomError)):
        cls = DloomError
    raise cls(record["message"])


def iter_decoded(
    prompts: Sequence[Prompt],
    spec: DecodeSpec,
    *,
    actors: int = 2,
    batch_size: int = 8,
    output_dir: str | os.PathLike | None = None,
    gpus_per_actor: float = 0,
    cpus_per_actor: float = 1,
) -> Iterator[dict[str, Any]]:
    """Decode ``prompts`` on Ray, yielding result rows as their batches finish.

    Rows already in ``output_dir``'s shards are yielded first, without decoding. Ray is
    started with its defaults when no runtime is connected (``ray.init()`` beforehand
    chooses the cluster).

    :param prompts: texts, or token-id lists (one kind).
    :param spec: the decoder each actor builds.
    :param actors: model replicas in the pool.
    :param batch_size: prompts per decoded batch (and per shard).
    :param output_dir: shard directory for resumable runs (created if missing).
    :param gpus_per_actor: GPUs reserved per actor (1 on a GPU cluster, with ``device="cuda"``).
    :param cpus_per_actor: CPUs reserved per actor; also its torch thread count.
    :raises ConfigurationError: for bad arguments, before Ray starts.
    :raises DloomError: the error an actor raised building its decoder or decoding.
    """
    _check_request(prompts, actors, batch_size, gpus_per_actor)
    done: dict[int, dict[str, Any]] = {}
    if output_dir is not None:
        done = _resumable_rows(Path(output_dir), prompts, spec)
    yield from (done[i] for i in sorted(done))
    todo = [{"index": i, "prompt": json.dumps(p)} for i, p in enumerate(prompts) if i not in done]
    if not todo:
        return

    try:
        import ray
    except ImportError as error:
        raise ConfigurationError(f"decoding on Ray needs Ray ({error}); pip install -e \".[ray]\" in a clone of dloom") from None

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    dataset = ray.data.from_items(todo).map_batches(
        DecodeActor,
        fn_constructor_kwargs={
            "spec": spec,
            "output_dir": None if output_dir is None else str(Path(output_dir).resolve()),
            "threads": max(1, int(cpus_per_actor)),
        },
        batch_size=batch_size,
        batch_format="numpy",
        concurrency=actors,
        num_cpus=cpus_per_actor,
        num_gpus=gpus_per_actor,
    )
    for record in dataset.iter_rows():
        row = json.loads(record["row"])
        if "error" in row:
            _raise_actor_error(row["error"])
        yield row


def decode_prompts(prompts: Sequence[Prompt], spec: DecodeSpec, **options: Any) -> list[dict[str, Any]]:
    """Decode ``prompts`` on Ray and return their result rows in request order.

    Takes the options of :func:`iter_decoded`.
    """
    rows = sorted(iter_decoded(prompts, spec, **options), key=lambda row: row["index"])
    return rows




@contextmanager
def driver_prints_to_stderr() -> Iterator[None]:
    """Keep Ray's own messages out of the driver's stdout while the block runs.

    Ray's driver prints what its raylet reports (``(raylet) A worker died or was killed
    ...``) to ``sys.stdout``, from a listener thread that runs as long as Ray does, whatever
    ``log_to_driver`` says; results written to stdout as JSON lines would then be mixed
    with it. Inside the block ``sys.stdout`` is ``sys.stderr`` (write results to the stream
    taken before it), and a Ray runtime the block started is shut down at its end, so that
    nothing of it prints later.
    """
    import sys

    ray = sys.modules.get("ray")
    running = ray is not None and ray.is_initialized()
    results = sys.stdout
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        ray = sys.modules.get("ray")
        if not running and ray is not None and ray.is_initialized():
            ray.shutdown()
        sys.stdout = results
