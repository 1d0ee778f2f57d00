"""MkDocs hooks for attnlab's site: a failing example names its page.

markdown-exec reports a code block that raised with the block and its traceback but not the
page it is on; with this hook its warning starts with the page's path
(``course/modern-decoder.md: markdown_exec: Execution of python code block exited with
errors``), as MkDocs' own warnings about dead links and missing pictures do.
"""

from __future__ import annotations

import logging

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


def on_page_markdown(markdown, page, **kwargs):
    global _page
    _page = page.file.src_uri
    return markdown


def on_page_content(html, page, **kwargs):
    global _page
    _page = None
    return html
