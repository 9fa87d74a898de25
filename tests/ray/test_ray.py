"""Ray Data batch decoding (dloom.ray) on a real local Ray runtime: two actors on this machine.

The rows must equal those of decoding each prompt alone in this process, across batch sizes,
actor counts and resumed runs; errors must surface as dloom's own, before decoding where the
request itself is wrong.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile

import pytest

ray = pytest.importorskip("ray", reason="the Ray tests need the optional extra ray (pip install -e '.[ray]')")

from dloom.errors import ConfigurationError, OutputError, UnknownStrategyError  # noqa: E402
from dloom.evaluation import select_examples  # noqa: E402
from dloom.ray import DecodeSpec, decode_prompts, iter_decoded, read_shards  # noqa: E402
from dloom.ray.batch import contiguous_runs  # noqa: E402

PROMPTS = [example.prompt for example in select_examples("all", 10, seed=3)]


@pytest.fixture(scope="module")
def ray_runtime():
    """A local Ray runtime with two CPUs, shut down after this module."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def alone(spec: DecodeSpec, prompts: list[str]) -> list[list[int]]:
    """Each prompt decoded by itself in this process (prompt i with its request index i)."""
    decoder = spec.build()
    return [decoder.generate([p], row_offset=i).row(0)["tokens"] for i, p in enumerate(prompts)]


@pytest.mark.parametrize(
    "strategy, params, batch_size, settings",
    [
        ("threshold", ("tau=0.9",), 4, {}),
        ("spiffy+threshold", ("tau=0.9", "spiffy.budget=10"), 3, {}),  # fixed: each actor would measure its own
        ("quota", (), 4, {"temperature": 1.0, "seed": 5}),  # sampled: per-prompt streams
    ],
)
def test_rows_equal_each_prompt_decoded_alone(ray_runtime, strategy, params, batch_size, settings):
    spec = DecodeSpec(
        strategy=strategy, params=params, settings={"gen_length": 32, "block_length": 8, **settings}
    )
    rows = decode_prompts(PROMPTS, spec, actors=2, batch_size=batch_size)
    assert [row["index"] for row in rows] == list(range(len(PROMPTS)))
    assert [row["prompt"] for row in rows] == PROMPTS
    assert [row["tokens"] for row in rows] == alone(spec, PROMPTS)
    assert all(row["nfe"] >= 1 and row["seconds"] > 0 for row in rows)


@pytest.mark.filterwarnings("ignore:no built-in draft graph")  # an uncalibrated graph still drafts at budget 10
def test_a_hook_swap_decodes_on_ray(ray_runtime):
    """``NAME@HOOK`` in a spec runs on the actors, with the rows of the composition it amounts to."""
    settings = {"gen_length": 32, "block_length": 8}
    params = ("tau=0.9", "spiffy.budget=10")
    spec = DecodeSpec(strategy="spiffy+quota+threshold@select_commit", params=params, settings=settings)
    rows = decode_prompts(PROMPTS[:4], spec, actors=1, batch_size=4)
    plain = DecodeSpec(strategy="spiffy+threshold", params=params, settings=settings)
    assert [row["tokens"] for row in rows] == alone(plain, PROMPTS[:4])
    assert {row["config"]["strategy"] for row in rows} == {spec.strategy}


QUOTA = DecodeSpec(strategy="quota")


@pytest.fixture(scope="module")
def sharded_run(ray_runtime, tmp_path_factory):
    """A finished run of PROMPTS in batches of 3, with its shard directory."""
    directory = tmp_path_factory.mktemp("shards")
    return decode_prompts(PROMPTS, QUOTA, actors=2, batch_size=3, output_dir=directory), directory


def test_each_batch_is_one_shard_of_rows_in_index_order(sharded_run):
    rows, directory = sharded_run
    shards = sorted(directory.glob("rows-*.jsonl"))
    assert [s.name for s in shards] == [
        "rows-00000000-00000002.jsonl", "rows-00000003-00000005.jsonl",
        "rows-00000006-00000008.jsonl", "rows-00000009-00000009.jsonl",
    ]
    indices = [json.loads(line)["index"] for s in shards for line in s.read_text().splitlines()]
    assert indices == list(range(len(PROMPTS)))
    assert json.loads((directory / "spec.json").read_text())["strategy"] == "quota"
    assert [r["tokens"] for r in rows] == alone(QUOTA, PROMPTS)


def test_a_finished_run_is_read_back_without_decoding(sharded_run, monkeypatch):
    rows, directory = sharded_run
    monkeypatch.setattr(ray.data, "from_items", lambda *a, **k: pytest.fail("decoded again"))
    again = iter_decoded(PROMPTS, QUOTA, output_dir=directory)
    assert [next(again)["index"] for _ in PROMPTS] == list(range(len(PROMPTS)))
    assert next(again, None) is None


def test_resume_refuses_another_decoder_or_request(sharded_run):
    _, directory = sharded_run
    with pytest.raises(ConfigurationError, match="rows of another decoder"):
        next(iter_decoded(PROMPTS, DecodeSpec(strategy="threshold"), output_dir=directory))
    with pytest.raises(ConfigurationError, match="not this request's prompt 0"):
        next(iter_decoded(["copy xyz", *PROMPTS[1:]], QUOTA, output_dir=directory))


def test_an_interrupted_run_resumes_from_its_shards(sharded_run, tmp_path):
    rows, directory = sharded_run
    for path in [directory / "spec.json", *directory.glob("rows-*.jsonl")]:
        (tmp_path / path.name).write_bytes(path.read_bytes())
    lost, kept = tmp_path / "rows-00000003-00000005.jsonl", tmp_path / "rows-00000000-00000002.jsonl"
    lost.unlink()  # as if the run had stopped before this batch finished
    kept_mtime = os.stat(kept).st_mtime_ns
    again = decode_prompts(PROMPTS, QUOTA, actors=2, batch_size=2, output_dir=tmp_path)
    assert [r["tokens"] for r in again] == [r["tokens"] for r in rows]
    assert os.stat(kept).st_mtime_ns == kept_mtime  # finished shards are not decoded again
    assert sorted(read_shards(tmp_path)) == list(range(len(PROMPTS)))
    assert "rows-00000003-00000004.jsonl" in {p.name for p in tmp_path.glob("rows-*.jsonl")}


def test_contiguous_runs():
    assert contiguous_runs([0, 1, 2, 5, 6, 9]) == [(0, 3), (3, 5), (5, 6)]
    assert contiguous_runs([4]) == [(0, 1)]


def test_a_corrupt_shard_is_named(tmp_path):
    (tmp_path / "rows-00000000-00000000.jsonl").write_text("{not json\n")
    with pytest.raises(ConfigurationError, match=r"rows-00000000-00000000.jsonl:1 is not a dloom result row"):
        read_shards(tmp_path)


@pytest.mark.parametrize(
    "prompts, options, words",
    [
        ("copy ab", {}, "one string"),
        ([], {}, "no prompts"),
        (["copy ab", [3, 4]], {}, "mix texts and input_ids"),
        (["copy ab"], {"actors": 0}, "actors is 0"),
        (["copy ab"], {"batch_size": 0}, "batch_size is 0"),
        (["copy ab"], {"gpus_per_actor": -1}, "gpus_per_actor is -1"),
    ],
)
def test_bad_requests_fail_before_ray_starts(prompts, options, words, monkeypatch):
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started for a bad request"))
    with pytest.raises(ConfigurationError, match=words):
        decode_prompts(prompts, DecodeSpec(), **options)


def no_permission(path):
    """Make creating files in ``path`` fail as it does without write permission (this
    process may be root, whom the mode bits do not stop)."""
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and os.path.samefile(dir, path):
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))
        return real(*args, dir=dir, **kwargs)

    return mkstemp


def output_dir_case(case, tmp_path, monkeypatch):
    """The output directory of ``case``, prepared as it names."""
    if case == "spec.json of bad JSON":
        (tmp_path / "spec.json").write_text('{"model": ')
        return tmp_path
    if case == "a file in its place":
        (tmp_path / "out").write_text("x")
        return tmp_path / "out"
    if case == "a file in place of a parent":
        (tmp_path / "parent").write_text("x")
        return tmp_path / "parent" / "out"
    if case == "no permission":
        monkeypatch.setattr(tempfile, "mkstemp", no_permission(tmp_path))
        return tmp_path
    if case == "a directory in place of a shard":
        (tmp_path / "rows-00000000-00000000.jsonl").mkdir()
        return tmp_path
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case, error, words",
    [
        ("spec.json of bad JSON", ConfigurationError, ["spec.json' is not the spec.json of a dloom run",
                                                        "line 1 column 11", "remove it"]),
        ("a file in its place", OutputError, ["/out' is a file, not a directory", "allowed: a directory"]),
        ("a file in place of a parent", OutputError, ["parent/out' lies under a file", "allowed: a directory"]),
        ("no permission", OutputError, ["cannot write into output_dir", "Permission denied", "allowed: a directory"]),
        ("a directory in place of a shard", ConfigurationError, ["rows-00000000-00000000.jsonl' cannot be read as a "
                                                                  "shard", "Is a directory"]),
    ],
)
def test_a_bad_output_dir_is_one_clear_error_before_ray_starts(case, error, words, tmp_path, monkeypatch):
    """Each was a raw JSONDecodeError, NotADirectoryError, PermissionError or IsADirectoryError."""
    directory = output_dir_case(case, tmp_path, monkeypatch)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started for a bad output directory"))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(error) as caught:
        decode_prompts(["copy ab"], QUOTA, output_dir=directory)
    message = str(caught.value)
    assert type(caught.value) is error and "\n" not in message
    assert str(tmp_path) in message
    for word in words:
        assert word in message, message


def test_a_shard_an_actor_cannot_write_is_an_output_error_not_a_ray_task_error(ray_runtime, tmp_path, monkeypatch):
    """The directory passes the driver's checks, then becomes a file before the actors write
    (here: as Ray Data starts); the actor's NotADirectoryError reached the driver as a
    RayTaskError."""
    directory = tmp_path / "out"
    real = ray.data.from_items

    def from_items(*args, **kwargs):
        shutil.rmtree(directory)
        directory.write_text("no longer a directory")
        return real(*args, **kwargs)

    monkeypatch.setattr(ray.data, "from_items", from_items)
    with pytest.raises(OutputError) as caught:
        decode_prompts(["copy ab"], QUOTA, actors=1, output_dir=directory)
    message = str(caught.value)
    assert "\n" not in message
    assert f"cannot write shard rows-00000000-00000000.jsonl into output_dir '{directory}'" in message
    assert "Not a directory" in message and "rerun to resume" in message


def test_an_actor_error_surfaces_as_the_dloom_error(ray_runtime, tmp_path):
    with pytest.raises(UnknownStrategyError, match="unknown strategy 'no-such-rule'"):
        decode_prompts(["copy ab"], DecodeSpec(strategy="no-such-rule"), actors=1, output_dir=tmp_path)
    assert not list(tmp_path.glob("rows-*.jsonl"))  # nothing written for a failed batch


def test_eval_on_ray_grades_as_the_single_process_eval(ray_runtime):
    """``dloom eval --ray 2`` streams the same graded rows and summary as ``dloom eval``."""
    from typer.testing import CliRunner

    from dloom.cli.commands import app

    command = ["eval", "-n", "8", "--strategy", "threshold", "--batch-size", "3", "--json"]
    runs = [CliRunner().invoke(app, command + extra) for extra in ([], ["--ray", "2"])]
    assert all(run.exit_code == 0 for run in runs), [run.output for run in runs]
    (*rows, summary), (*ray_rows, ray_summary) = ([json.loads(line) for line in run.stdout.splitlines()] for run in runs)
    assert sorted(ray_rows, key=lambda r: r["prompt"]) == sorted(rows, key=lambda r: r["prompt"])
    for key in ("accuracy", "per_task", "nfe_mean", "tpf", "n", "complete"):
        assert ray_summary[key] == summary[key], key
    assert ray_summary["config"]["ray_actors"] == 2
