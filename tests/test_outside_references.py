"""No docstring or comment of the packages points at a file outside the repository: the
project's design notes live elsewhere, so a reference to them is one a reader cannot follow."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("core", "plugins")
OUTSIDE = re.compile(r"DESIGN\.md|ALGORITHMS\.md|TRAINING-NOTES\.md|\.\./shared\b|/shared/")


def outside_references(text: str) -> list[tuple[int, str]]:
    """``(line number, match)`` for every reference to a file outside the repository."""
    return [
        (number, match.group(0))
        for number, line in enumerate(text.splitlines(), start=1)
        for match in OUTSIDE.finditer(line)
    ]


def test_the_detector_finds_every_outside_name():
    sample = (
        '"""See DESIGN.md, section 3."""\n'
        "x = 1  # as in ALGORITHMS.md\n"
        "# TRAINING-NOTES.md has the schedule\n"
        ":func:`f` (``../shared/notes``)\n"
        "DESIGNS.md is fine, docs/design.md too\n"
    )
    assert [name for _, name in outside_references(sample)] == [
        "DESIGN.md", "ALGORITHMS.md", "TRAINING-NOTES.md", "../shared",
    ]


def test_no_source_file_refers_outside_the_repository():
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for folder in PACKAGE_DIRS
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, name in outside_references(path.read_text(encoding="utf-8"))
    ]
    assert (ROOT / "core" / "dloom" / "decode" / "decoder.py").is_file()  # the scan sees the package
    assert found == [], "\n".join(found)
