"""A griffe extension for the documentation site: the ``>>>`` examples in attnlab's
docstrings become ``pycon`` code blocks.

attnlab's docstrings put their doctest example after the Google-style sections, without an
``Examples:`` header (the test suite runs them with ``--doctest-modules``). Markdown would
read the ``>>>`` lines as nested block quotes; this extension fences each run of doctest
lines (from a ``>>>`` line to the next blank line) so the site shows them as code. Sphinx
roles (``:func:`~attnlab.trace` ``), which some docstrings use, become inline code, and a
paragraph that ends in reStructuredText's ``::`` before an indented block ends in ``:``.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`(~?)([\w.]+)(?:\(\))?`")


def plain_roles(text: str) -> str:
    """``:func:`~a.b.c` `` -> `` `c` ``, ``:class:`a.B` `` -> `` `a.B` ``."""
    return _ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)


def fence_doctests(text: str) -> str:
    """Wrap every run of doctest lines of ``text`` in a ``pycon`` fence."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>"):
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}```pycon")
            while i < len(lines) and lines[i].strip():
                out.append(lines[i])
                i += 1
            out.append(f"{indent}```")
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fence the doctest examples of every docstring griffe loads; roles become code."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            text = plain_roles(fence_doctests(obj.docstring.value))
            obj.docstring.value = re.sub(r"(?<=\S)::$", ":", text, flags=re.M)
