"""Task-suite evaluation and the ``dloom eval`` / ``dloom demo`` commands."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_model
from dloom.cli.commands import app
from dloom.decode.decoders import Decoder
from dloom.errors import ConfigurationError
from dloom.evaluation import evaluate, select_examples
from dloom.metrics import GenerationResult
from dloom.zoo import long_tasks
from dloom.zoo import tokenizer as zoo_tokenizer
from dloom.zoo.tasks import FAMILIES

runner = CliRunner()


@pytest.fixture
def char_model_dir(tmp_path: Path) -> Path:
    """A tiny random bidirectional model with the zoo's character tokenizer."""
    path = tmp_path / "char-dllm"
    model = tiny_model(
        vocab_size=len(zoo_tokenizer.vocab()), mask_token_id=zoo_tokenizer.MASK_ID,
        eos_token_id=zoo_tokenizer.EOS_ID, pad_token_id=zoo_tokenizer.PAD_ID,
    )
    model.config.dloom = {"attention": "bidirectional", "gen_length": 8}
    model.to(torch.float32).save_pretrained(path)
    zoo_tokenizer.save(path)
    return path


class ScriptedDecoder:
    """A :class:`dloom.decode.decoders.Decoder` that answers every other example correctly, two
    forwards per row, 4 tokens per row."""

    model = None
    name = "scripted"
    config = {"strategy": "scripted"}

    def totals(self):
        return None

    def generate(self, prompts, row_offset=0):
        texts = [self.answers[p] if i % 2 == 0 else "wrong" for i, p in enumerate(prompts)]
        batch = len(prompts)
        return GenerationResult(
            sequences=torch.zeros(batch, 4), generated=torch.zeros(batch, 4),
            generated_lengths=torch.full((batch,), 4), nfe=torch.full((batch,), 2), forwards=2,
            wall_seconds=0.5, hook_seconds={"forward": 0.25}, config=self.config, texts=texts,
        )


def test_evaluate_counts_accuracy_nfe_tpf_tps():
    examples = select_examples("add,sort", 8)
    decoder = ScriptedDecoder()
    assert isinstance(decoder, Decoder)
    decoder.answers = {e.prompt: e.answer for e in examples}
    report = evaluate(decoder, examples, batch_size=4)
    assert report.n == 8
    assert report.accuracy == pytest.approx(0.5)
    assert set(report.per_task) == {"add", "sort"}
    assert report.per_task["add"]["n"] == 4
    assert report.nfe_mean == 2.0
    assert report.tpf == pytest.approx(2.0)  # 4 tokens / 2 forwards
    assert report.tps == pytest.approx(32 / 1.0)  # 8 rows x 4 tokens over 2 batches x 0.5 s
    assert report.hook_share == {"forward": pytest.approx(0.5)}


def test_evaluate_draws_nothing_and_reports_each_graded_batch(capfd):
    examples = select_examples("add,sort", 10)
    decoder = ScriptedDecoder()
    decoder.answers = {e.prompt: e.answer for e in examples}
    batches = []
    report = evaluate(decoder, examples, batch_size=4, on_batch=batches.append)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert [r for b in batches for r in b] == report.outputs
    assert capfd.readouterr() == ("", "")  # no progress bar: the command line draws it


def test_the_command_line_draws_the_progress_from_the_callback(monkeypatch):
    from rich.console import Console

    from dloom.cli import commands

    screen = io.StringIO()
    monkeypatch.setattr(commands, "err_console", Console(file=screen, force_terminal=True, width=80))
    handed = []
    with commands.progress_bar("eval scripted", 10, handed.append) as on_batch:
        for size in (4, 4, 2):
            on_batch([{}] * size)
    assert [len(records) for records in handed] == [4, 4, 2]
    drawn = screen.getvalue()
    assert "eval scripted" in drawn and "  0%" in drawn and "100%" in drawn
    monkeypatch.setattr(commands, "err_console", Console(file=screen, force_terminal=False))
    with commands.progress_bar("eval scripted", 10, handed.append) as on_batch:
        on_batch([{}] * 10)
    assert screen.getvalue() == drawn and len(handed) == 4  # off a terminal: not drawn, not even a blank line


def test_select_examples_errors():
    with pytest.raises(ConfigurationError, match="unknown task family 'poetry'; known: all, "):
        select_examples("add,poetry", 4)
    with pytest.raises(ConfigurationError, match="-n is 0; allowed: a positive number"):
        select_examples("all", 0)


class EditingDecoder(ScriptedDecoder):
    """:class:`ScriptedDecoder` on an editing kernel: rows 0 and 2 of a batch answer right,
    row 0 from a wrong draft; row 1 answers wrong from a right draft; row 3 is wrong in both.
    Row ``i`` took ``i`` edits."""

    def generate(self, prompts, row_offset=0):
        result = super().generate(prompts, row_offset)
        right = [self.answers[p] for p in prompts]
        result.draft_texts = ["wrong", right[1], right[2], "wrong"][: len(prompts)]
        result.edits = torch.arange(len(prompts))
        return result


def test_evaluate_reports_edits_and_the_answers_an_edit_fixed_or_broke():
    examples = select_examples("add,sort", 8)
    decoder = EditingDecoder()
    decoder.answers = {e.prompt: e.answer for e in examples}
    report = evaluate(decoder, examples, batch_size=4)
    assert report.accuracy == pytest.approx(0.5)
    assert [o["edits"] for o in report.outputs] == [0, 1, 2, 3] * 2
    assert [o["draft_correct"] for o in report.outputs] == [False, True, True, False] * 2
    assert report.edits_per_answer == pytest.approx(1.5)
    assert report.fixed_by_edit_share == pytest.approx(0.25)  # row 0 of each batch
    assert report.broken_by_edit_share == pytest.approx(0.25)  # row 1 of each batch
    data = report.to_json()
    assert (data["edits_per_answer"], data["fixed_by_edit_share"], data["broken_by_edit_share"]) == (1.5, 0.25, 0.25)
    plain = ScriptedDecoder()
    plain.answers = decoder.answers
    fills = evaluate(plain, examples, batch_size=4)
    assert fills.edits_per_answer is None and fills.fixed_by_edit_share is None
    assert "edits_per_answer" not in fills.to_json() and "edits" not in fills.outputs[0]


def test_eval_json_schema(char_model_dir):
    result = runner.invoke(
        app, ["eval", "--model", str(char_model_dir), "--strategy", "threshold", "-n", "6",
              "--tasks", "copy,reverse", "--json"],
    )
    assert result.exit_code == 0, result.output
    *rows, data = map(json.loads, result.stdout.splitlines())  # a line per example, then the summary
    assert len(rows) == 6 and {r["family"] for r in rows} == {"copy", "reverse"}
    assert set(data) >= {"accuracy", "per_task", "nfe_mean", "tpf", "tps", "n", "config", "complete"}
    assert data["n"] == 6 and set(data["per_task"]) == {"copy", "reverse"}
    assert 0.0 <= data["accuracy"] <= 1.0 and data["nfe_mean"] > 0 and data["tps"] > 0
    assert data["config"]["strategy"] == "threshold"
    assert data["config"]["params"] == {"threshold": {"tau": 0.7}}
    assert data["config"]["gen_length"] == 8


def test_eval_static_shapes_grades_the_same_outputs(char_model_dir):
    """``dloom eval --static-shapes`` decodes the same outputs in the same NFE, and records
    the setting; an AR-target strategy refuses it before any work."""
    args = ["eval", "--model", str(char_model_dir), "--strategy", "threshold", "-n", "6", "--cache", "dual",
            "--tasks", "copy,reverse", "--json", "--outputs"]
    default, static = runner.invoke(app, args), runner.invoke(app, [*args, "--static-shapes"])
    assert default.exit_code == static.exit_code == 0, static.output
    first, second = (json.loads(r.stdout.splitlines()[-1]) for r in (default, static))
    assert second["outputs"] == first["outputs"] and second["nfe_mean"] == first["nfe_mean"]
    assert second["config"]["static_shapes"] is True and first["config"]["static_shapes"] is False
    refused = runner.invoke(app, ["eval", "--strategy", "failfast", "-n", "2", "--static-shapes"])
    assert refused.exit_code == 2 and "--static-shapes applies to diffusion decoding" in refused.output


def test_eval_decodes_the_suite_the_model_s_tokenizer_writes(char_model_dir, tmp_path):
    """``--tasks auto`` (the default): the toy suite for the toy tokenizer, the long-answer
    suite for the long zoo's wider one; ``--tasks`` still picks the suite itself."""
    path = tmp_path / "long-char-dllm"
    vocab = zoo_tokenizer.vocab(long_tasks.ALPHABET)
    model = tiny_model(vocab_size=len(vocab), mask_token_id=zoo_tokenizer.MASK_ID,
                       eos_token_id=zoo_tokenizer.EOS_ID, pad_token_id=zoo_tokenizer.PAD_ID)
    model.config.dloom = {"attention": "bidirectional", "gen_length": 8}
    model.to(torch.float32).save_pretrained(path)
    zoo_tokenizer.save(path, long_tasks.ALPHABET)

    def families(*args):
        result = runner.invoke(app, ["eval", "--strategy", "threshold", "-n", "4", "--json", *args])
        assert result.exit_code == 0, result.output
        return set(json.loads(result.stdout.splitlines()[-1])["per_task"])

    assert families("--model", str(path)) == set(long_tasks.FAMILIES)
    assert families("--model", str(char_model_dir)) <= set(FAMILIES)
    assert families("--model", str(path), "--tasks", "word") == {"word"}


def test_eval_unknown_task_exits_2(char_model_dir):
    result = runner.invoke(app, ["eval", "--model", str(char_model_dir), "--tasks", "poetry"])
    assert result.exit_code == 2 and "unknown task family" in result.output


def test_demo_compares_every_commit_rule_with_the_baseline(char_model_dir):
    result = runner.invoke(app, ["demo", "--model", str(char_model_dir), "-n", "7", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    rows = {row["strategy"]: row for row in data["rows"]}
    assert {"quota", "threshold", "factor", "spiffy+quota"} <= set(rows)
    assert not [name for name in rows if name.startswith("failfast")]  # an AR target's strategy: not tried
    assert "skipped" not in result.stderr
    assert rows["quota"]["identical_to_baseline"] == 1.0
    assert rows["quota"]["nfe_ratio_vs_baseline"] == 1.0
    assert rows["quota"]["nfe_mean"] == 8.0  # one token per step over gen_length 8
