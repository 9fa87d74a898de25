"""A griffe extension for the API reference (mkdocs.yml): dloom's docstrings are written
in Sphinx's reStructuredText, the site in Markdown. It rewrites, in every docstring griffe
loads, the inline roles (``:class:`~dloom.sdk.KernelStep```) into code spans (the last
component for a ``~`` target, as Sphinx shows it) and a paragraph's literal-block marker
(a trailing ``::``) into a colon, so that no raw role or marker reaches a page.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(~?)\.?([^`]+)`")
LITERAL_MARKER = re.compile(r"(?<=\S)::$", re.MULTILINE)


def markdown(text: str) -> str:
    """``text`` with its Sphinx roles as code spans and its ``::`` markers as colons."""
    def code(match: re.Match[str]) -> str:
        short, target = match.groups()
        return f"`{target.rsplit('.', 1)[-1] if short else target}`"

    return LITERAL_MARKER.sub(":", ROLE.sub(code, text))


class SphinxRoles(griffe.Extension):
    """Rewrite each object's docstring as it is loaded (:func:`markdown`)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
