"""Griffe extension: read the reST bits of interlock's docstrings as Markdown.

The docstrings are Google style with reST inline markup (trio's habit): ``:class:`X```
roles, ``literal`` in double backticks and ``text::`` before an indented example. Double
backticks are a Markdown code span already; this turns a role into a code span (``~``
keeps the last dotted part, as Sphinx does), ``text::`` into ``text:``, so the
indented example after it reads as a code block, and a definition list (a term with its
definition indented under it) into Markdown's.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")
LITERAL_BLOCK = re.compile(r"(\S)::$", re.MULTILINE)
# a reST definition list: a term, then its definition indented under it (no blank line)
DEFINITION = re.compile(r"^([^\s].*[^:\s])\n    (?=\S)", re.MULTILINE)


def _code(match: re.Match[str]) -> str:
    target = match[2]
    if match[1]:
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def markdown_of(text: str) -> str:
    text = LITERAL_BLOCK.sub(r"\1:", ROLE.sub(_code, text))
    return DEFINITION.sub(r"\n\1\n:   ", text)


class RstInline(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        # the package itself is not among the objects on_object sees
        if pkg.docstring is not None:
            pkg.docstring.value = markdown_of(pkg.docstring.value)

    def on_object(self, *, obj: griffe.Object, loader: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_of(obj.docstring.value)
