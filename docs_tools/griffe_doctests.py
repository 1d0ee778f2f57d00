"""A griffe extension for the documentation site: the ``>>>`` examples in attnlab's
docstrings become ``pycon`` code blocks.

attnlab's docstrings put their doctest example after the Google-style sections, without an
``Examples:`` header (the test suite runs them with ``--doctest-modules``). Markdown would
read the ``>>>`` lines as nested block quotes; this extension fences each run of doctest
lines (from a ``>>>`` line to the next blank line) so the site shows them as code.
"""

from __future__ import annotations

import griffe


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
    """Fence the doctest examples of every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
