"""The course as notebooks: each course page is also ``course/PAGE.ipynb``, made from its
Markdown when the site is built (docs_tools/notebooks.py) and linked under its title. Each
notebook runs offline in a real kernel (nbclient) and prints what its page shows."""

from __future__ import annotations

import html
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COURSE = sorted(p.stem for p in (ROOT / "docs" / "course").glob("*.md") if p.name != "index.md")
sys.path.insert(0, str(ROOT))

from docs_tools import notebooks  # noqa: E402

TIMES: dict[str, float] = {}


def page_outputs(page_html: str) -> dict[int, dict]:
    """``block -> {"code": the highlighted blocks' texts, "images": the alt texts}`` of each
    markdown-exec block of a built page, read between its ``<!-- attnlab block N -->``
    markers: a block that shows its source has it first, then its printed text."""
    parts = re.split(r"<!-- attnlab block (\d+) -->", page_html)
    out = {}
    for number, part in zip(parts[1::2], parts[2::2], strict=True):
        codes = re.findall(r'<div class="[^"]*highlight"><pre><span></span><code>(.*?)</code></pre></div>', part, re.S)
        out[int(number)] = {"code": [html.unescape(re.sub(r"<[^>]+>", "", c)) for c in codes],
                            "images": re.findall(r'<img alt="([^"]*)"', part)}
    return out


def test_a_page_becomes_a_notebook():
    text = "\n".join([
        "---", "needs: [torch]", "---", "# A page", "", "Some *prose*; see [the next](next.md) page.", "",
        '```python exec="on" session="p"', "import numpy as np", "```", "",
        '```python exec="on" session="p" source="above" result="text"', "print(np.arange(3))", "```", "",
        "```bash", "make docs", "```", "",
        '```python exec="on" session="p" html="true"', "print('<b>bold</b>')", "```", "",
        '!!! note "Mind this"', "", "    Indented advice.", "",
        "<!-- solution: causal_mask -->",
    ])
    nb = notebooks.notebook(text, page="course/a.md", course_pages={"next.md"})
    cells = nb["cells"]
    kinds = [c["cell_type"] for c in cells]
    assert kinds == ["code", "markdown", "code", "code", "markdown", "code", "markdown"]
    assert cells[0]["metadata"]["jupyter"]["source_hidden"] and "page_output" in cells[0]["source"]
    assert "(next.ipynb)" in cells[1]["source"] and "needs:" not in cells[1]["source"]
    assert cells[2]["metadata"] == {"attnlab": {"block": 0, "output": "markdown"}, "jupyter": {"source_hidden": True}}
    assert cells[3]["metadata"] == {"attnlab": {"block": 1, "output": "text"}}
    assert "```bash\nmake docs\n```" in cells[4]["source"]
    assert cells[5]["source"].startswith("%%page_output html\n")
    assert "> **Mind this**" in cells[6]["source"]
    assert "<details><summary>A solution of causal_mask" in cells[6]["source"]
    assert "def causal_mask(L, S):" in cells[6]["source"]
    marked = notebooks.mark_blocks(text)
    assert marked.count("<!-- attnlab block") == 3 and "<!-- attnlab block 2 -->" in marked
    page = notebooks.expand("<!-- exercise: softmax -->\n\n<!-- solution: softmax -->", notebook=False)
    assert page.startswith("```python\ndef softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:")
    assert "...  # your code" in page and '??? success "A solution of softmax' in page


def test_every_course_page_links_its_notebook(site):
    nbformat = pytest.importorskip("nbformat")
    for name in COURSE:
        page = (site / "course" / f"{name}.html").read_text(encoding="utf-8")
        assert f'href="{name}.ipynb"' in page and f'download="{name}.ipynb"' in page, name
        nb = nbformat.read(site / "course" / f"{name}.ipynb", as_version=4)
        nbformat.validate(nb)
        assert nb.metadata["attnlab"]["page"] == f"course/{name}.md"
        assert sum("attnlab" in c.metadata for c in nb.cells) == page.count("<!-- attnlab block ")
        assert "<details" in page and "A solution of" in page  # the solution, closed until opened


@pytest.mark.parametrize("name", COURSE)
def test_the_notebook_runs_and_prints_what_its_page_shows(site, name, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(site / "course" / f"{name}.ipynb", as_version=4)
    shown = page_outputs((site / "course" / f"{name}.html").read_text(encoding="utf-8"))
    env = {"PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""), "MPLBACKEND": "Agg"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                    resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    TIMES[name] = time.perf_counter() - start
    print(f"\n{name}.ipynb: {len(nb.cells)} cells run in {TIMES[name]:.1f} s")
    compared = 0
    for cell in nb.cells:
        meta = cell.metadata.get("attnlab")
        if meta is None:
            continue
        want = shown[meta["block"]]
        outputs = cell.get("outputs", [])
        assert not [o for o in outputs if o.output_type == "error"], (name, meta)
        if meta["output"] == "text":
            printed = "".join(o.text for o in outputs if o.output_type == "stream" and o.name == "stdout")
            hidden = cell.metadata.get("jupyter", {}).get("source_hidden", False)
            text = want["code"][0 if hidden else 1]
            # (the page trims the blank lines around a block's text)
            assert printed.strip("\n") == text.strip("\n"), (name, meta["block"], printed, text)
            compared += 1
        elif meta["output"] == "html":
            shown_html = "".join(o.data.get("text/html", "") for o in outputs if o.output_type == "display_data")
            assert re.findall(r'<img alt="([^"]*)"', shown_html) == want["images"], (name, meta["block"])
            compared += 1
    assert compared >= 3
    json.dumps(nb)  # the executed notebook is still plain JSON
