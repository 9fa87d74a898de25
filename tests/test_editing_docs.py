"""The worked editing rule of ``docs/editing.md``: installed from the page through an entry
point, ``dloom check`` passes it with every claim of the revisable kernel holding, and fails
it, naming the edit budget, once it edits past its budget."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from dloom.cli.commands import app

PAGE = Path(__file__).resolve().parents[1] / "docs" / "editing.md"


def worked_example() -> str:
    found = re.search(r'^```python title="dloom_margin_edit.py"\n(.*?)^```', PAGE.read_text(), re.S | re.M)
    assert found, "docs/editing.md lost its worked example"
    return found.group(1)


def check(site, source: str) -> tuple[int, dict]:
    site.install("dloom_margin_edit", source, ep_name="margin-edit")
    result = CliRunner().invoke(app, ["check", "--strategy", "margin-edit", "--json"])
    return result.exit_code, json.loads(result.stdout)


def test_the_worked_editing_rule_passes_dloom_check(site):
    code, report = check(site, worked_example())
    assert code == 0, report
    claims = report["evidence"]["kernel_claims"]["revisable"]
    assert report["failed_claims"] == [] and claims, report
    assert {c["verdict"] for c in claims["claims"].values()} == {"holds"}, claims


def test_the_same_rule_editing_past_its_budget_is_caught(site):
    source = worked_example()
    broken = source.replace("in_budget = (schedule.post_steps <= self.rounds).unsqueeze(1)", "in_budget = True")
    assert broken != source
    code, report = check(site, broken)
    assert code == 1 and report["verdict"] == "kernel claim broken"
    assert report["failed_claims"] == ["edit_budget"], report
