"""The course's pages as Jupyter notebooks, made from the same Markdown when the site is
built (docs_tools/hooks.py writes ``course/PAGE.ipynb`` next to each page and links it).

How a page becomes a notebook:

- prose becomes Markdown cells; links to other course pages point to their notebooks;
  an admonition (``!!! note``) becomes a quoted paragraph, a closed one (``??? ...``) a
  ``<details>`` block, closed until opened, as on the page;
- every ``python exec="on"`` block (markdown-exec, run when the site is built) becomes a code
  cell, in order, with its number in the cell's metadata (``attnlab.block``) so that its
  outputs can be compared with the page's (the page carries ``<!-- attnlab block N -->``
  before the block); a block the page runs without showing (no ``source``) is a cell whose
  source is collapsed; a block whose printed text is HTML (``html="true"``) or Markdown (no
  ``result``) is shown as such (the ``%%page_output`` cell magic of the first cell);
- other Python blocks become code cells too; ``bash``/``text`` blocks stay in the prose;
- ``<!-- exercise: NAME -->`` and ``<!-- solution: NAME -->`` (see :func:`expand`) become the
  exercise's statement and its solution, closed, from :mod:`attnlab.exercises`, on the page
  and in the notebook alike.

The first cell, collapsed, sets the notebook up as the site's build is: pictures drawn off
screen (each is shown by a cell of its own, as on the page) and the ``%%page_output`` magic.
"""

from __future__ import annotations

import inspect
import json
import re
import textwrap

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")
_MARKER = re.compile(r"^<!-- (exercise|solution): (\w+) -->$", re.M)
_ADMONITION = re.compile(r'^(!!!|\?\?\?\+?) *(\w+)(?: +"(.*)")? *$')

SETUP = '''\
# The setup of this notebook (as when the site is built): pictures are drawn off screen and each
# is shown by a cell of its own; %%page_output shows what a cell prints as HTML or Markdown.
import contextlib
import io

import matplotlib
from IPython.core.magic import register_cell_magic
from IPython.display import HTML, Markdown, display

matplotlib.use("Agg")


@register_cell_magic
def page_output(kind, cell):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        get_ipython().ex(cell)
    if printed.getvalue():
        display(HTML(printed.getvalue()) if kind.strip() == "html" else Markdown(printed.getvalue()))
'''


# ---- the exercises' statements and solutions ---------------------------------------------------
def task_source(name: str) -> str:
    """The exercise ``name`` as the function to write: its signature and docstring."""
    from docs_tools.griffe_doctests import plain_roles

    from attnlab.exercises import task

    source = inspect.getsource(task(name))
    head, _, _ = source.rpartition("    _yours(")
    return plain_roles(head.rstrip()) + "\n    ...  # your code\n"


def solution_source(name: str) -> str:
    """The worked solution of ``name``, with the earlier solutions it calls named."""
    from attnlab.exercises import names, solution

    source = inspect.getsource(solution(name))
    used = [n for n in names() if n != name and re.search(rf"\b{n}\(", source)]
    if used:
        source = f"# with {', '.join(used)} of the earlier exercises\n" + source
    return source


def expand(text: str, *, notebook: bool) -> str:
    """``<!-- exercise: NAME -->`` -> the task as a Python block; ``<!-- solution: NAME -->``
    -> the solution, closed (a ``???`` block on the page, ``<details>`` in a notebook)."""
    def one(m: re.Match) -> str:
        kind, name = m.group(1), m.group(2)
        if kind == "exercise":
            return f"```python\n{task_source(name)}```"
        code = solution_source(name).rstrip("\n")
        title = f"A solution of {name} (open it once you have tried)"
        if notebook:
            return f"<details><summary>{title}</summary>\n\n```python\n{code}\n```\n\n</details>"
        return f'??? success "{title}"\n\n' + textwrap.indent(f"```python\n{code}\n```", "    ")

    return _MARKER.sub(one, text)


# ---- reading a page ---------------------------------------------------------------------------
def _front_matter(text: str) -> str:
    m = re.match(r"---\n.*?\n---\n", text, re.S)
    return text[m.end():] if m else text


def _info(info: str) -> tuple[str, dict]:
    lang = re.sub(r"\{.*\}", "", info).split()
    attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', info))
    return (lang[0].lower() if lang else ""), attrs


def segments(text: str) -> list[tuple[str, object]]:
    """The page as ``("markdown", str)`` and ``("code", {"lang", "attrs", "source"})`` parts,
    top-level fences only (a fence inside an admonition stays in its Markdown)."""
    out: list[tuple[str, object]] = []
    prose: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or m.group("indent"):
            prose.append(lines[i])
            i += 1
            continue
        fence = m.group("fence")
        j = i + 1
        while j < len(lines) and not re.match(rf"^{fence[0]}{{{len(fence)},}}\s*$", lines[j]):
            j += 1
        lang, attrs = _info(m.group("info").strip())
        if lang in ("python", "py", "pycon"):
            out.append(("markdown", "\n".join(prose)))
            prose = []
            out.append(("code", {"lang": lang, "attrs": attrs, "source": "\n".join(lines[i + 1:j])}))
        else:
            prose.extend(lines[i:j + 1])
        i = j + 1
    out.append(("markdown", "\n".join(prose)))
    return [(k, v) for k, v in out if k == "code" or v.strip()]


def executed(block: dict) -> bool:
    """A markdown-exec block: run when the site is built."""
    return block["lang"] in ("python", "py", "pycon") and block["attrs"].get("exec") in ("on", "1", "true", "yes")


def mark_blocks(text: str) -> str:
    """``text`` with ``<!-- attnlab block N -->`` before its ``N``-th markdown-exec block
    (counted from 0, as :func:`notebook` numbers the cells)."""
    lines = text.split("\n")
    out, n, i = [], 0, 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m and not m.group("indent"):
            fence = m.group("fence")
            j = i + 1
            while j < len(lines) and not re.match(rf"^{fence[0]}{{{len(fence)},}}\s*$", lines[j]):
                j += 1
            lang, attrs = _info(m.group("info").strip())
            if executed({"lang": lang, "attrs": attrs}):
                out += [f"<!-- attnlab block {n} -->", ""]
                n += 1
            out += lines[i:j + 1]
            i = j + 1
            continue
        out.append(lines[i])
        i += 1
    return "\n".join(out)


# ---- writing a notebook -------------------------------------------------------------------------
def _prose(text: str, page_links: set[str]) -> str:
    """A Markdown cell's text: admonitions as quotes or <details>, links to course pages as
    links to their notebooks."""
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = _ADMONITION.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        title = m.group(3) or m.group(2).capitalize()
        body = []
        i += 1
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith("    ")):
            body.append(lines[i][4:])
            i += 1
        content = "\n".join(body).strip("\n")
        if m.group(1).startswith("???"):
            out += [f"<details><summary>{title}</summary>", "", content, "", "</details>", ""]
        else:
            out += [f"> **{title}**", ">"] + [f"> {line}".rstrip() for line in content.split("\n")] + [""]

    def link(m: re.Match) -> str:
        target = m.group(1)
        return f"]({target[:-3]}.ipynb)" if target in page_links else m.group(0)

    return re.sub(r"\]\(([\w-]+\.md)(?:#[\w-]*)?\)", link, "\n".join(out)).strip("\n")


def _cell(kind: str, source: str, **metadata) -> dict:
    cell = {"cell_type": kind, "metadata": metadata, "source": source}
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def _code(block: dict) -> str:
    source = block["source"]
    if block["lang"] == "pycon" or source.lstrip().startswith(">>>"):
        source = "\n".join(line[4:] for line in source.split("\n") if line[:4] in (">>> ", "... "))
    return source


def notebook(text: str, *, page: str, course_pages: set[str] = frozenset()) -> dict:
    """The notebook (nbformat 4, as a dict) of the Markdown page ``text`` (``page``: its path
    in docs/, e.g. ``course/cross-attention.md``; ``course_pages``: the file names whose
    links become links to notebooks)."""
    cells = [_cell("code", SETUP, jupyter={"source_hidden": True}, tags=["setup"])]
    n = 0
    for kind, part in segments(_front_matter(text)):
        if kind == "markdown":  # (an exercise's statement and solution stay in the prose, closed)
            prose = _prose(expand(part, notebook=True), set(course_pages))
            if prose:
                cells.append(_cell("markdown", prose))
            continue
        source = _code(part)
        if not executed(part):
            cells.append(_cell("code", source))
            continue
        attrs = part["attrs"]
        output = "html" if attrs.get("html") in ("true", "1", "yes", "on") else \
            "text" if attrs.get("result") else "markdown"
        if output in ("html", "markdown") and "print(" in source:
            source = f"%%page_output {output}\n{source}"
        meta = {"attnlab": {"block": n, "output": output}}
        if not attrs.get("source"):
            meta["jupyter"] = {"source_hidden": True}
        cells.append(_cell("code", source, **meta))
        n += 1
    return {
        "cells": cells,
        "metadata": {
            "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
            "attnlab": {"page": page, "made_from": f"docs/{page}"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def notebook_json(text: str, *, page: str, course_pages: set[str] = frozenset()) -> str:
    """:func:`notebook` as the ``.ipynb`` file's text (cells carry ids: nbformat 4.5)."""
    nb = notebook(text, page=page, course_pages=course_pages)
    for i, cell in enumerate(nb["cells"]):
        cell["id"] = f"cell-{i}"
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
