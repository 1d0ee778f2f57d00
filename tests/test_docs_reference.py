"""The reference pages read the docstrings as they are written: one Returns entry per
function (a tuple is one returned thing, described in one paragraph), and long signatures
formatted (mkdocstrings runs ``ruff format`` on them)."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _griffe_options() -> dict:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8").replace("!!python", "#"))
    handler = next(p for p in config["plugins"] if isinstance(p, dict) and "mkdocstrings" in p)["mkdocstrings"]
    return handler["handlers"]["python"]["options"]["docstring_options"]


def test_every_returns_section_is_one_entry():
    griffe = pytest.importorskip("griffe")
    options = _griffe_options()
    assert options.get("returns_multiple_items") is False
    package = griffe.load("attnlab", search_paths=[str(ROOT / "src")], docstring_parser=griffe.Parser.google,
                          docstring_options=options)
    several, seen, checked = [], set(), 0

    def walk(obj):
        nonlocal checked
        if obj.path in seen:
            return
        seen.add(obj.path)
        for member in list(obj.members.values()):
            if member.is_alias:
                continue
            if member.is_function and member.docstring:
                for section in member.docstring.parsed:
                    if section.kind.value == "returns":
                        checked += 1
                        if len(section.value) != 1:
                            several.append(f"{member.path}: {len(section.value)} entries")
            if member.is_module or member.is_class:
                walk(member)

    walk(package)
    assert checked > 40 and not several, several


def test_the_reference_tables_and_signatures_as_built(site):
    page = (site / "reference" / "functional.html").read_text(encoding="utf-8")
    start = page.index('id="attnlab.blockwise_attention_forward"')
    entry = page[start:page.index('class="doc doc-heading"', start + 100)]
    returns = entry[entry.index("Returns:"):] if "Returns:" in entry else entry[entry.index(">Returns<"):]
    rows = re.findall(r"<tr[^>]*>\s*<td", returns.split("</table>")[0])
    assert len(rows) == 1, "blockwise_attention_forward's Returns table has one row"
    signature = html.unescape(re.sub(r"<[^>]+>", "", re.search(r'class="doc-signature[^"]*"(.*?)</code>',
                                                                   entry, re.S).group(1)))
    assert signature.count("\n") >= 3, signature  # one parameter a line, as ruff formats it
