"""A Griffe extension for the site: attnkit's docstrings use a few reStructuredText habits
(``:func:`name```, ``:class:`~a.b.C```, a paragraph ending in ``::`` before an indented
block). mkdocstrings renders Markdown, so this turns the roles into code spans and ``::``
into ``:`` (the indented block after it is already a Markdown code block). The docstrings
themselves stay as they are."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")
LITERAL = re.compile(r"(\S)::[ \t]*$", re.M)


def to_markdown(text: str) -> str:
    """``:func:`~a.b.c``` → ```c```, ``:class:`a.B``` → ```a.B```, ``Shapes::`` → ``Shapes:``."""
    text = ROLE.sub(lambda m: "`" + (m.group(2).rsplit(".", 1)[-1] if m.group(1)
                                      else m.group(2)) + "`", text)
    return LITERAL.sub(r"\1:", text)


class RstRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
