"""Debian's Chromium driven by Playwright, for the browser tests (the HTML report's and the
documentation site's). Never a browser download: without /usr/bin/chromium (``make browser``
installs it) or Playwright the calling module is skipped, with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"

# No network of its own: no updates, no sync, no background requests, no QUIC.
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions",
]


def sync_api_or_skip():
    """Playwright's sync API; skips the calling module when Chromium or Playwright is missing."""
    if not Path(CHROMIUM).exists():
        pytest.skip(
            f"{CHROMIUM} not found: install Debian's chromium (make browser) to run the browser tests",
            allow_module_level=True,
        )
    return pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')"
    )


def launch(playwright):
    """Debian's Chromium, headless, with the arguments above."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
