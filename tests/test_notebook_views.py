"""The report's views one at a time inside Jupyter (attnlab.viz.show): each carries only
what it draws, the script comes once per page, and in a notebook run by nbclient and
exported by nbconvert, Chromium shows three or more views that work independently, with
no console error and no request to another host."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

from attnlab.viz import notebook, show
from report_data import inside_explanation, random_explanation

SCRIPT_MARK = "attnlab interactive attention report"


@pytest.fixture
def fresh_page(monkeypatch):
    """A notebook that has shown no view yet."""
    monkeypatch.setitem(notebook._sent, "script", False)


def _data(fragment: str) -> dict:
    return json.loads(re.search(r'class="al-data">(.*?)</script>', fragment, re.S).group(1))


def test_a_view_is_sized_to_what_it_shows(fresh_page):
    e = inside_explanation(5, 30, 9)  # SmolLM2's 30 layers of 9 heads, 5 tokens
    head = show(e, "head")._repr_html_()
    later = show(e, "model")._repr_html_()
    print(f"\nhead view with the script: {len(head.encode()) / 1e3:.1f} KB; a later view: "
          f"{len(later.encode()) / 1e3:.1f} KB")
    assert len(head.encode()) < 120_000 and len(later.encode()) < 20_000
    assert head.count(SCRIPT_MARK) == 1 and later.count(SCRIPT_MARK) == 0  # the script once per page
    assert "window.attnlabReport.start()" in later
    d = _data(head)
    assert d["lens"] is None and d["patching"] is None and d["detectors"] is None and d["embedding"] is None
    assert d["steps"] == [] and d["arrays"]["attn"]["shape"] == [30, 9, 5, 5]
    lens = _data(show(e, "lens").html)
    assert lens["lens"] is not None and lens["arrays"]["attn"]["shape"][0] == 0  # no maps in the lens view
    assert 'data-view-only="lens"' in show(e, "lens").html
    assert show(e, "patching", script=True)._repr_html_().count(SCRIPT_MARK) == 1


def test_an_explanation_shows_its_head_view_not_the_whole_report(fresh_page):
    from attnlab.viz import render_html

    e = inside_explanation(5, 30, 9)
    shown = e._repr_html_()
    assert len(shown.encode()) < 120_000
    assert _data(shown)["lens"] is None and _data(render_html(e, inline=True))["lens"] is not None  # one view
    assert 'data-view-only="head"' in shown and "attnlab.viz.show(e, view=...)" in shown
    assert "'lens'" in shown and "'patching'" in shown and "'rollout'" not in shown  # the views it has


def test_views_without_their_data_are_refused():
    e = random_explanation(5, 2, 2)
    for view, why in (("lens", "only decoders have a logit lens"), ("patching", "no activation patching"),
                      ("steps", "no step-by-step trace")):
        with pytest.raises(ValueError, match=why):
            show(e, view)
    with pytest.raises(ValueError, match="view must be one of head, model"):
        show(e, "heads")
    with pytest.raises(ValueError, match="layer"):
        show(e, "head", layer=9)
    assert _data(show(e, "head", layer=1, head=1).html)["head"] == 1


# ---- a notebook, executed, exported and opened in Chromium -------------------------------------
NOTEBOOK = [
    ("markdown", "# Three views of one explanation, and one of another"),
    ("code", "from attnlab.explain import explain\nimport attnlab.viz\n"
             "e = explain('The cat sat on the mat. The cat sat', model='gpt2', path=FOLDER,\n"
             "            corrupt='The cat sat on the log. The cat sat')\nlen(e.tokens)"),
    ("code", "attnlab.viz.show(e, view='head')"),
    ("code", "attnlab.viz.show(e, view='model')"),
    ("code", "attnlab.viz.show(e, view='lens')"),
    ("code", "attnlab.viz.show(e, view='patching')"),
    ("code", "explain('A bird flew over the house', model='gpt2', path=FOLDER)  # an Explanation: its head view"),
]


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from helpers import byte_bpe_tokenizer
    from test_hostile import write_gpt2

    folder = write_gpt2(tmp_path_factory.mktemp("nb-gpt2") / "gpt2", {"vocab_size": 300, "n_layer": 3, "n_head": 4,
                                                                          "n_embd": 32, "n_positions": 64})
    byte_bpe_tokenizer(folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def exported(gpt2_folder, tmp_path_factory):
    """The notebook executed by nbclient (a real kernel) and exported by nbconvert to HTML,
    with nbconvert's own CDN scripts (require.js, MathJax, Mermaid) left out of its template."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nbconvert = pytest.importorskip("nbconvert")
    pytest.importorskip("ipykernel")
    out = tmp_path_factory.mktemp("nb")
    cells = []
    for kind, source in NOTEBOOK:
        source = source.replace("FOLDER", repr(str(gpt2_folder)))
        cells.append(nbformat.v4.new_markdown_cell(source) if kind == "markdown" else nbformat.v4.new_code_cell(source))
    nb = nbformat.v4.new_notebook(cells=cells)
    env_path = os.environ.get("PYTHONPATH", "")
    src = str(Path(__file__).resolve().parents[1] / "src")
    os.environ["PYTHONPATH"] = src + (os.pathsep + env_path if env_path else "")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                    resources={"metadata": {"path": str(out)}}).execute()
    finally:
        os.environ["PYTHONPATH"] = env_path
        if not env_path:
            del os.environ["PYTHONPATH"]
    nbformat.write(nb, out / "views.ipynb")
    template = out / "templates" / "offline"
    template.mkdir(parents=True)
    (template / "conf.json").write_text(json.dumps({"base_template": "lab", "mimetypes": {"text/html": True}}))
    (template / "index.html.j2").write_text(
        "{%- extends 'lab/index.html.j2' -%}\n"
        "{%- block html_head_js -%}{%- endblock html_head_js -%}\n"
        "{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}\n"
        "{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}\n")
    exporter = nbconvert.HTMLExporter(extra_template_basedirs=[str(out / "templates")], template_name="offline")
    body, _ = exporter.from_notebook_node(nb)
    page = out / "views.html"
    page.write_text(body, encoding="utf-8")
    return nb, page


def test_the_notebook_outputs_hold_each_view_once(exported):
    nb, page = exported
    html_outputs = [o["data"]["text/html"] for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                    if "text/html" in o.get("data", {})]
    assert len(html_outputs) == 5
    sizes = [len(h.encode()) for h in html_outputs]
    print(f"\nnotebook view outputs (bytes): {sizes}; exported page {page.stat().st_size / 1e3:.0f} KB")
    assert sizes[0] < 200_000 and max(sizes[1:]) < 60_000
    assert sum(h.count(SCRIPT_MARK) for h in html_outputs) == 1 == page.read_text().count(SCRIPT_MARK)
    assert not re.search(r'(src|href)="(https?:)?//', page.read_text())  # nothing from another host


def test_the_views_work_independently_in_chromium(exported, tmp_path):
    from browser import launch, sync_api_or_skip

    sync_api = sync_api_or_skip()
    _, page_path = exported
    shots = Path(os.environ.get("ATTNLAB_NOTEBOOK_SCREENS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    requests, errors = [], []
    with sync_api.sync_playwright() as p:
        browser = launch(p)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        page.on("request", lambda r: requests.append(r.url))
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(page_path.resolve().as_uri())
        page.wait_for_function("document.querySelectorAll('.attnlab-view[data-ready]').length === 5",
                               timeout=30_000)
        roots = page.query_selector_all(".attnlab-view")
        assert [r.get_attribute("data-view") for r in roots] == ["head", "model", "lens", "patching", "head"]
        assert all(r.get_attribute("data-ready") == "1" for r in roots)
        assert all(r.query_selector(".al-tabs") is None and r.query_selector(".al-fallback") is None for r in roots)
        assert all(r.query_selector("svg.al-view") is not None for r in roots)

        page.evaluate("""() => document.querySelectorAll('.attnlab-view').forEach(r => {
            new MutationObserver(() => { r.dataset.n = String(Number(r.dataset.n || 0) + 1); })
              .observe(r.querySelector('.al-stage'), {childList: true}); })""")
        head, model, lens, patching, other = roots
        # the head view: one head alone (a double click), then a layer; only that view redraws
        head.query_selector('.al-chip[data-head="2"]').dblclick()
        head.query_selector("select.al-layer").select_option("2")
        assert head.query_selector_all('.al-chip[aria-pressed="true"]')[0].get_attribute("data-head") == "2"
        assert head.query_selector("svg.al-view text").text_content().startswith("layer 2, heads 2")
        redrawn = [int(r.evaluate("e => e.dataset.n || '0'")) for r in roots]
        assert redrawn[0] >= 2 and redrawn[1:] == [0, 0, 0, 0]
        # the model view: a thumbnail click keeps the model view (no head view to jump to)
        model.query_selector_all(".al-thumb")[5].click()
        assert model.get_attribute("data-view") == "model"
        # the lens view: the pointer over a cell shows its top tokens in that view's tooltip
        cell = lens.query_selector("svg.al-view").bounding_box()
        page.mouse.move(cell["x"] + cell["width"] * 0.6, cell["y"] + cell["height"] * 0.5)
        page.wait_for_timeout(100)
        tips = [r.query_selector(".al-tip").evaluate("e => e.style.display") for r in roots]
        assert tips[2] == "block" and tips.count("block") == 1
        assert head.get_attribute("data-view") == "head" and other.query_selector("svg.al-view") is not None
        page.screenshot(path=str(shots / "notebook-views.png"), full_page=True)
        for name, root in zip(("head", "model", "lens", "patching", "explanation"), roots, strict=True):
            root.screenshot(path=str(shots / f"notebook-view-{name}.png"))
        browser.close()
    print(f"\nChromium: {len(requests)} requests, screenshots in {shots}")
    assert not errors, errors
    assert all(u.startswith(("file://", "data:", "blob:")) for u in requests), requests
    assert np.all([(shots / f"notebook-view-{n}.png").stat().st_size > 2_000
                   for n in ("head", "model", "lens", "patching")])
