"""The README's examples run as pasted, without test helpers; the suite skips the file,
naming what is missing, where a package one of them needs is not installed.

The whole run (tests, the doctests in src/, the README) never measures the machine:
attnlab takes its typical tuning figures and decides nothing by the machine's load
(``ATTNLAB_TUNE=off``; see tests/conftest.py and attnlab._tuning)."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ["ATTNLAB_TUNE"] = "off"  # before attnlab reads it (at its first decision)

# The README's one example needs the core alone (the site's pages name their own installs,
# tests/test_docs_site.py); list a package here if a README example comes to need it.
README_NEEDS: tuple[str, ...] = ()


def pytest_collection_modifyitems(config, items):
    missing = [m for m in README_NEEDS if importlib.util.find_spec(m) is None]
    if not missing:
        return
    for item in items:
        if item.path.name == "README.md":
            item.add_marker(pytest.mark.skip(reason=f"the README's examples need {', '.join(missing)}"))
