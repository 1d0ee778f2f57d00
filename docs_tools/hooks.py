"""MkDocs hooks for attnlab's site: a failing example names its page, and the course's
pages are also notebooks.

Every course page (but the index) gets ``course/PAGE.ipynb``, made from its Markdown by
:mod:`docs_tools.notebooks`, and a link to it under its title; its exercises' statements
and solutions (``<!-- exercise: NAME -->``, ``<!-- solution: NAME -->``) come from
:mod:`attnlab.exercises`; each markdown-exec block is preceded by ``<!-- attnlab block N -->``
so that the tests can compare the notebook's outputs with the page's.

markdown-exec reports a code block that raised with the block and its traceback but not the
page it is on; with this hook its warning starts with the page's path
(``course/modern-decoder.md: markdown_exec: Execution of python code block exited with
errors``), as MkDocs' own warnings about dead links and missing pictures do.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs_tools, importable by the hooks

from docs_tools import notebooks  # noqa: E402

_page: str | None = None


class _NamePage(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name.startswith("mkdocs.plugins.markdown_exec")
        if _page and ours and not getattr(record, "_attnlab_page", False):
            record.msg = f"Doc file '{_page}': {record.msg}"
            record._attnlab_page = True
        return True


_filter = _NamePage()


def on_config(config, **kwargs):
    for handler in logging.getLogger("mkdocs").handlers:
        if _filter not in handler.filters:
            handler.addFilter(_filter)
    return config


def _course_pages(docs_dir: str) -> list[Path]:
    return sorted(p for p in (Path(docs_dir) / "course").glob("*.md") if p.name != "index.md")


def on_files(files, config, **kwargs):
    """The course's notebooks, made from their pages, as files of the site."""
    from mkdocs.structure.files import File

    pages = _course_pages(config["docs_dir"])
    names = {p.name for p in pages}
    for path in pages:
        uri = f"course/{path.stem}.ipynb"
        text = notebooks.notebook_json(path.read_text(encoding="utf-8"), page=f"course/{path.name}",
                                       course_pages=names)
        files.append(File.generated(config, uri, content=text))
    return files


def on_page_markdown(markdown, page, **kwargs):
    global _page
    _page = page.file.src_uri
    uri = page.file.src_uri
    if uri.startswith("course/") and uri != "course/index.md":
        markdown = notebooks.mark_blocks(notebooks.expand(markdown, notebook=False))
        name = Path(uri).stem + ".ipynb"
        link = (f"*This page is also a Jupyter notebook: [{name}]({name}){{ download=\"{name}\" }} (it runs "
                "offline with the light install, `make demo`, and Jupyter).*")
        title, sep, rest = markdown.partition("\n")
        markdown = f"{title}\n\n{link}\n{sep}{rest}" if title.startswith("# ") else f"{link}\n\n{markdown}"
    return markdown


def on_page_content(html, page, **kwargs):
    global _page
    _page = None
    return html
