"""The HTML report in real headless Chromium (Debian's package, driven by Playwright).

Each test opens a report from file://, uses it as a person would (switch layer and head,
hover, click, export) and checks that the page made no network request, opened no dialog
and logged no error. Screenshots are saved under the test's tmp_path.
"""

from __future__ import annotations

import io
import json
import re
import struct
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from attnlab.viz import html_report as rep
from browser import launch, sync_api_or_skip
from report_data import XSS_IMG, XSS_SCRIPT, inside_explanation, random_explanation, traced_explanation

sync_api = sync_api_or_skip()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = launch(p)
        yield b
        b.close()


class Session:
    """A page with everything it did recorded."""

    def __init__(self, browser, tmp_path: Path):
        self.context = browser.new_context(
            accept_downloads=True, viewport={"width": 1280, "height": 900}
        )
        self.page = self.context.new_page()
        self.tmp = tmp_path
        self.requests: list[str] = []
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("dialog", self._dialog)
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def _dialog(self, d):
        self.dialogs.append(f"{d.type}: {d.message}")
        d.dismiss()

    def open(self, path: Path, *, root: str = ".attnlab-report"):
        self.url = path.resolve().as_uri()
        self.page.goto(self.url)
        self.page.wait_for_selector(f"{root}[data-ready]", timeout=30_000)
        assert self.page.get_attribute(root, "data-ready") == "1"
        return self.page

    def shot(self, name: str) -> Path:
        out = self.tmp / f"{name}.png"
        self.page.screenshot(path=str(out), full_page=True)
        assert _png_size(out.read_bytes())[0] > 0
        return out

    def download(self, selector: str) -> tuple[str, bytes]:
        with self.page.expect_download(timeout=20_000) as info:
            self.page.click(selector)
        d = info.value
        target = self.tmp / d.suggested_filename
        d.save_as(str(target))
        return d.suggested_filename, target.read_bytes()

    def check_clean(self):
        """No network, no dialog, no error: the file is all there is."""
        self.page.wait_for_timeout(200)  # let late events (image errors, timers) arrive
        others = [
            u for u in self.requests if u != self.url and not u.startswith(("data:", "blob:"))
        ]
        assert others == [], f"network requests: {others}"
        assert self.dialogs == [], f"dialogs: {self.dialogs}"
        assert self.errors == [], f"console/page errors: {self.errors}"


@pytest.fixture
def session(browser, tmp_path):
    s = Session(browser, tmp_path)
    yield s
    s.context.close()


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _png_pixels(data: bytes) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(io.BytesIO(data), format="png")


def _lines(page) -> str:
    return page.inner_html(".al-stage .al-lines")


def test_head_model_heatmap_export(session, tmp_path):
    text = "the quick brown fox jumps over the lazy dog again and again"
    e = random_explanation(12, 3, 4, text=text, tokens=text.split(), model="random test model")
    page = session.open(rep.write_report(e, tmp_path / "report.html"))

    header = page.inner_text(".al-head")
    assert "random test model" in header and "the quick brown fox" in header
    assert e.created in header
    session.shot("head-view")

    # head view: switching layer and heads changes the drawing
    before = _lines(page)
    assert page.locator('.al-lines path[data-head="0"]').count() > 0
    assert page.input_value(".al-layer") == "2"  # opens on the explanation's layer: the last
    page.select_option(".al-layer", "0")
    after_layer = _lines(page)
    assert after_layer != before
    page.click('.al-chip[data-head="0"]')  # hide head 0
    assert page.get_attribute('.al-chip[data-head="0"]', "aria-pressed") == "false"
    assert page.locator('.al-lines path[data-head="0"]').count() == 0
    assert _lines(page) != after_layer
    page.click(".al-none")
    assert page.locator(".al-lines path").count() == 0
    page.dblclick('.al-chip[data-head="1"]')  # that head alone
    drawn = page.eval_on_selector_all(".al-lines path", "ps => ps.map(p => p.dataset.head)")
    assert set(drawn) == {"1"}
    page.click(".al-all")
    # hovering a query token isolates its lines: every segment starts at that token's row
    page.hover('.al-tok[data-side="0"][data-idx="3"]')
    ds = page.eval_on_selector_all(".al-lines path", "ps => ps.map(p => p.getAttribute('d'))")
    starts = {m for d in ds for m in re.findall(r"M([\d.]+ [\d.]+)L", d)}
    assert len(starts) == 1
    session.shot("head-view-hover")
    page.mouse.move(5, 5)
    assert _lines(page) != ""

    # model view: a layers x heads grid; clicking a thumbnail opens it in the head view
    page.click('.al-tab[data-view="model"]')
    assert page.locator(".al-thumb").count() == 3 * 4
    session.shot("model-view")
    page.click('.al-thumb[data-layer="1"][data-head="2"]')
    assert page.get_attribute(".attnlab-report", "data-view") == "head"
    assert page.input_value(".al-layer") == "1"
    pressed = page.eval_on_selector_all(".al-chip", "cs => cs.map(c => c.ariaPressed)")
    assert pressed == ["false", "false", "true", "false"]
    drawn = page.eval_on_selector_all(".al-lines path", "ps => ps.map(p => p.dataset.head)")
    assert set(drawn) == {"2"}

    # heatmap: the value under the pointer
    page.click('.al-tab[data-view="heatmap"]')
    page.click('.al-chip[data-head="3"]')
    box = page.locator(".al-stage .al-hit").bounding_box()
    i, j, T = 4, 7, 12
    cw, ch = box["width"] / T, box["height"] / T
    page.mouse.move(box["x"] + (j + 0.5) * cw, box["y"] + (i + 0.5) * ch)
    tip = page.inner_text(".al-tip")
    assert f"query {i}" in tip and f"key {j}" in tip
    shown = float(re.search(r"weight ([\d.]+)", tip).group(1))
    want = e.attentions[1, 3, i, j]
    assert abs(shown - want) <= e.attentions[1, 3, i].max() / 510 + 1e-4
    session.shot("heatmap-view")

    # exports: a PNG and an SVG of the current view, made in the page (no network)
    name, png = session.download(".al-export-png")
    assert name == "attnlab-heatmap-layer2-head3.png"  # layers are numbered 1..n
    w, h = _png_size(png)
    assert w > 300 and h > 300
    pixels = _png_pixels(png)
    assert pixels.shape[:2] == (h, w) and pixels[..., :3].std() > 0.05  # not blank
    name, svg = session.download(".al-export-svg")
    assert name.endswith(".svg")
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert b"<script" not in svg and b"al-hit" not in svg
    page.click('.al-tab[data-view="head"]')
    name, png = session.download(".al-export-png")
    assert name == "attnlab-head-layer2.png" and _png_size(png)[1] > 200
    session.check_clean()


def test_steps_and_embedding_views(session, tmp_path):
    e = traced_explanation(heads=2, causal=True)
    page = session.open(rep.write_report(e, tmp_path / "steps.html"))
    page.click('.al-tab[data-view="steps"]')
    names = page.eval_on_selector_all(".al-step", "gs => gs.map(g => g.dataset.name)")
    for want in ("X", "Q", "K", "V", "scores", "weights", "output"):
        assert want in names
    text = page.inner_text(".al-stage")
    assert "X (3, 4)" in text and "Q (3, 3)" in text and "-\u221e" in text
    session.shot("steps-head0")
    before = page.inner_html(".al-stage")
    page.click('.al-chip[data-head="1"]')
    assert page.inner_html(".al-stage") != before
    # the weights card shows head 1's weights; the pointer reads a value
    card = page.locator('.al-step[data-name="weights"] .al-hit')
    box = card.bounding_box()
    page.mouse.move(box["x"] + 2.5 * box["width"] / 3, box["y"] + 2.5 * box["height"] / 3)
    tip = page.inner_text(".al-tip")
    assert tip.startswith("weights[2, 2]")
    assert abs(float(tip.split("\n")[1]) - e.attentions[0, 1, 2, 2]) < 1e-3
    session.shot("steps-head1")
    _, png = session.download(".al-export-png")
    assert _png_size(png)[0] > 500

    page.click('.al-tab[data-view="embedding"]')
    assert page.locator(".al-dot").count() == 2 * 3
    page.hover('.al-dot[data-kind="1"][data-idx="2"]')
    assert "attention" in page.inner_text(".al-tip")
    session.shot("embedding")
    _, svg = session.download(".al-export-svg")
    assert ET.fromstring(svg).tag.endswith("svg")
    session.check_clean()


def test_without_trace_the_steps_tab_is_off(session, tmp_path):
    page = session.open(rep.write_report(random_explanation(5, 1, 2), tmp_path / "r.html"))
    assert page.is_disabled('.al-tab[data-view="steps"]')
    assert "random numbers for a test" in page.inner_text(".al-notes")
    session.check_clean()


def _check_xss_page(session, page):
    body = page.inner_text("body")
    assert XSS_IMG in body and XSS_SCRIPT in body  # shown as text
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.evaluate("document.querySelectorAll('[onerror]').length") == 0
    page.hover(".al-tok[data-side='0'][data-idx='1']")
    page.click('.al-tab[data-view="heatmap"]')
    stage = page.inner_text(".al-stage")  # labels are shortened, but shown as text
    assert "<b>bold</b>" in stage and "<img src=x on" in stage and "</script><scr" in stage
    page.click('.al-tab[data-view="embedding"]')
    page.hover('.al-dot[data-kind="1"][data-idx="2"]')
    assert XSS_SCRIPT[:20] in page.inner_text(".al-tip")
    page.wait_for_timeout(300)
    session.check_clean()


XSS_TOKENS = ["hello", XSS_IMG, XSS_SCRIPT, "<b>bold</b>", "&amp;", "end"]


def test_hostile_text_runs_nothing(session, tmp_path):
    e = random_explanation(0, 2, 2, tokens=XSS_TOKENS, text=f"hello {XSS_IMG} {XSS_SCRIPT}",
                           model=XSS_IMG)
    page = session.open(rep.write_report(e, tmp_path / "xss.html"))
    assert page.title() == f"attnlab report: {XSS_IMG}"
    _check_xss_page(session, page)
    session.shot("xss")


def test_inline_fragments_like_jupyter(session, tmp_path):
    """Two inline reports on one page (as in a notebook), without the page's CSP: the
    escaping alone must keep the hostile text inert, and the reports must not interfere."""
    a = random_explanation(0, 2, 2, tokens=XSS_TOKENS, text=XSS_SCRIPT, model=XSS_IMG)
    b = random_explanation(7, 1, 3, seed=5, model="second model")
    page_html = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>notebook</title></head><body>"
        f"<div class='cell'>{rep.render_html(a, inline=True)}</div>"
        f"<div class='cell'>{rep.render_html(b, inline=True)}</div>"
        "</body></html>"
    )
    path = tmp_path / "notebook.html"
    path.write_text(page_html, encoding="utf-8")
    page = session.open(path, root=".cell:nth-child(2) .attnlab-report")
    page.wait_for_selector(".cell:nth-child(1) .attnlab-report[data-ready='1']")
    assert page.locator(".al-stage").count() == 2
    second = page.locator(".cell:nth-child(2) .attnlab-report")
    second.locator('.al-tab[data-view="model"]').click()
    assert second.locator(".al-thumb").count() == 3
    assert page.locator(".cell:nth-child(1) .attnlab-report").get_attribute("data-view") == "head"
    session.shot("inline")
    _check_xss_page(session, page)


def test_256_tokens_6_layers_12_heads(session, tmp_path, capsys):
    """The scale case: prints file size and timings (asserts only that everything renders)."""
    e = random_explanation(256, 6, 12, dim=64)
    path = rep.write_report(e, tmp_path / "big.html")
    size = path.stat().st_size
    t0 = time.perf_counter()
    page = session.open(path)
    wall = time.perf_counter() - t0
    render = float(page.get_attribute(".attnlab-report", "data-render-ms"))
    times = {}
    for view in ("model", "heatmap", "embedding", "head"):
        page.click(f'.al-tab[data-view="{view}"]')
        assert page.get_attribute(".attnlab-report", "data-view") == view
        times[view] = float(page.get_attribute(".attnlab-report", "data-last-render-ms"))
    page.select_option(".al-layer", "5")
    times["layer switch"] = float(page.get_attribute(".attnlab-report", "data-last-render-ms"))
    assert page.locator(".al-lines path").count() > 0
    session.shot("big-head-view")
    session.check_clean()
    with capsys.disabled():
        print(f"\n256x6x12 report: {size / 2**20:.2f} MiB, open-to-ready {wall * 1000:.0f} ms "
              f"(script {render:.0f} ms), views (ms): {json.dumps(times)}")


@pytest.mark.parametrize("tokens", [["only"], ["", " ", "\n", "a"]], ids=["one-token", "blank-tokens"])
def test_small_and_odd_inputs_render_every_view(session, tmp_path, tokens):
    e = random_explanation(0, 1, 1, tokens=tokens, dim=3)
    page = session.open(rep.write_report(e, tmp_path / "r.html"))
    for view in ("head", "model", "heatmap", "embedding"):
        page.click(f'.al-tab[data-view="{view}"]')
        assert page.locator(".al-stage svg").count() == 1
    page.click('.al-tab[data-view="model"]')
    _, png = session.download(".al-export-png")
    pixels = _png_pixels(png)
    assert pixels[..., :3].min() < 0.5  # the thumbnail (an embedded image) is in the PNG
    page.click('.al-tab[data-view="head"]')
    # hovering a key token isolates the lines that reach it
    page.hover(f'.al-tok[data-side="1"][data-idx="{len(tokens) - 1}"]')
    ds = page.eval_on_selector_all(".al-lines path", "ps => ps.map(p => p.getAttribute('d'))")
    ends = {m for d in ds for m in re.findall(r"L([\d.]+ [\d.]+)", d)}
    assert len(ends) == 1
    session.check_clean()


# ---- any token text exports; long texts get a window; the embedding and step views -----------
ODD_TOKENS = ["nul\x00", "\x01bell\x07", "tab\there", "vt\x0b", "\ufffe", "lone\ud800", "😀" * 20,
              "del\x7f", "\u2028", "ok"]


def test_export_works_with_any_token_text(session, tmp_path):
    e = random_explanation(0, 2, 2, tokens=ODD_TOKENS, text="".join(ODD_TOKENS), model="odd\x00model")
    page = session.open(rep.write_report(e, tmp_path / "odd.html"))
    assert "\u2400" in page.inner_text(".al-head")  # NUL shown as its control picture
    for view in ("head", "model", "heatmap", "embedding"):
        page.click(f'.al-tab[data-view="{view}"]')
        name, svg = session.download(".al-export-svg")
        root = ET.fromstring(svg)  # well-formed XML whatever the tokens hold
        assert root.tag.endswith("svg"), name
        assert b"\x00" not in svg and b"\x01" not in svg and b"\x0b" not in svg
        name, png = session.download(".al-export-png")
        assert page.get_attribute(".attnlab-report", "data-exported") == name
        assert _png_size(png)[0] > 200
    page.click('.al-tab[data-view="head"]')
    labels = page.eval_on_selector_all(".al-tok text", "ts => ts.map(t => t.textContent)")
    assert "nul\u2400" in labels and "lone\ufffd" in labels
    assert all("\ud83d" not in t or "\ude00" in t for t in labels)  # an emoji is never cut in half
    session.check_clean()


def test_long_text_is_shown_a_window_at_a_time(session, tmp_path, capsys):
    T = 2500
    e = random_explanation(T, 1, 2, dim=16)
    with pytest.warns(UserWarning, match="2500 tokens"):
        path = rep.write_report(e, tmp_path / "long.html")
    t0 = time.perf_counter()
    page = session.open(path)
    wall = time.perf_counter() - t0
    assert "2500 tokens" in page.inner_text(".al-warn")
    assert page.locator('.al-tok[data-side="0"]').count() == rep.WINDOW
    assert page.inner_text(".al-win-info") == "0\u2013499 of 2500"
    times = {"open": wall * 1000}
    for view in ("model", "heatmap", "embedding", "head"):
        page.click(f'.al-tab[data-view="{view}"]')
        times[view] = float(page.get_attribute(".attnlab-report", "data-last-render-ms"))
    page.click(".al-win-next")
    times["move"] = float(page.get_attribute(".attnlab-report", "data-last-render-ms"))
    assert page.inner_text(".al-win-info") == "250\u2013749 of 2500"
    first = page.get_attribute('.al-tok[data-side="0"]', "data-idx")
    assert first == "250"
    page.fill(".al-win-start", "99999")
    page.dispatch_event(".al-win-start", "change")
    assert page.inner_text(".al-win-info") == "2000\u20132499 of 2500"
    assert page.is_disabled(".al-win-next")
    page.click('.al-tab[data-view="heatmap"]')
    box = page.locator(".al-stage .al-hit").bounding_box()
    page.mouse.move(box["x"] + 3.5 * box["width"] / 500, box["y"] + 1.5 * box["height"] / 500)
    tip = page.inner_text(".al-tip")
    assert "query 2001" in tip and "key 2003" in tip
    shown = float(re.search(r"weight ([\d.]+)", tip).group(1))
    assert abs(shown - e.attentions[0, 0, 2001, 2003]) <= e.attentions[0, 0, 2001].max() / 510 + 1e-4
    name, _ = session.download(".al-export-png")
    assert name == "attnlab-heatmap-layer1-head0-tokens2000-2499.png"  # layers numbered 1..n
    session.shot("long-heatmap")
    session.check_clean()
    with capsys.disabled():
        print(f"\n2500-token report: views (ms): {json.dumps({k: round(v) for k, v in times.items()})}")


def _boxes(page, selector):
    return page.eval_on_selector_all(selector, """ts => ts.map(t => {
        const b = t.getBBox(); return [t.textContent, b.x, b.y, b.x + b.width, b.y + b.height]; })""")


def _overlaps(boxes):
    out = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if min(a[3], b[3]) - max(a[1], b[1]) > 0.5 and min(a[4], b[4]) - max(a[2], b[2]) > 0.5:
                out.append((a[0], b[0]))
    return out


def test_embedding_view_labels_arrows_and_zoom(session, tmp_path):
    tokens = ["[CLS]", "the", "cat", "sat", "on", "the", "mat", "[SEP]"]
    rng = np.random.default_rng(3)
    static = rng.standard_normal((8, 6)) * 3
    static[5] = static[1]  # equal words, equal static vectors
    contextual = static.mean(0) + 0.01 * rng.standard_normal((8, 6))  # they huddle together
    contextual[7] = contextual[1] + 1e-4  # two nearly equal points ("the", "[SEP]")
    e = random_explanation(0, 1, 2, tokens=tokens)
    e.static, e.contextual = static, contextual
    page = session.open(rep.write_report(e, tmp_path / "emb.html"))
    page.click('.al-tab[data-view="embedding"]')
    static_labels = page.eval_on_selector_all('.al-point-label[data-kind="0"]',
                                              "ts => ts.map(t => t.textContent)")
    assert sorted(static_labels) == sorted(["[CLS]", "the \u00d72", "cat", "sat", "on", "mat", "[SEP]"])
    assert page.locator(".al-emb-zoom").count() == 1 and page.locator(".al-zoom-box").count() == 1
    zoomed = page.eval_on_selector_all('.al-emb-zoom .al-point-label[data-kind="1"]',
                                       "ts => ts.map(t => t.textContent)")
    assert sorted(zoomed) == sorted(tokens)
    assert page.locator(".al-arrowhead").count() == 8
    assert _overlaps(_boxes(page, ".al-point-label")) == []
    session.shot("embedding-zoom")
    session.check_clean()


def test_embedding_labels_spread_without_zoom(session, tmp_path):
    tokens = [f"word{i}" for i in range(12)]
    rng = np.random.default_rng(4)
    static = rng.standard_normal((12, 4))
    static[1:6] = static[0] + 0.002 * rng.standard_normal((5, 4))  # a tight cluster of six
    contextual = static + 0.5 * rng.standard_normal((12, 4))
    e = random_explanation(0, 1, 1, tokens=tokens)
    e.static, e.contextual = static, contextual
    page = session.open(rep.write_report(e, tmp_path / "spread.html"))
    page.click('.al-tab[data-view="embedding"]')
    boxes = _boxes(page, ".al-point-label")
    assert len(boxes) == 24 and _overlaps(boxes) == []
    session.shot("embedding-spread")
    session.check_clean()


def test_steps_show_whole_descriptions(session, tmp_path):
    e = traced_explanation(heads=1)
    long = ("the scores divided by the square root of the head dimension, so that the softmax "
            "stays soft when the head dimension grows; this sentence is long on purpose")
    for step in e.trace.steps:
        if step.name == "scaled_scores":
            step.description = long
    page = session.open(rep.write_report(e, tmp_path / "steps.html"))
    page.click('.al-tab[data-view="steps"]')
    lines = page.eval_on_selector_all('.al-step[data-name="scaled_scores"] .al-desc',
                                      "ts => ts.map(t => t.textContent)")
    assert len(lines) > 1 and " ".join(lines) == long
    assert "\u2026" not in page.inner_text(".al-stage")
    session.check_clean()


# ---- what explain reads from inside a decoder: the lens, the head detectors, patching -----------


def _tip_at(page, selector, i, j, rows, cols):
    box = page.locator(selector).bounding_box()
    page.mouse.move(box["x"] + (j + 0.5) * box["width"] / cols, box["y"] + (i + 0.5) * box["height"] / rows)
    return page.inner_text(".al-tip")


def test_lens_detector_and_patching_views(session, tmp_path):
    T, L, H = 10, 3, 4
    e = inside_explanation(T, L, H)
    page = session.open(rep.write_report(e, tmp_path / "inside.html"))
    for view in ("lens", "detectors", "patching"):
        assert not page.is_disabled(f'.al-tab[data-view="{view}"]')

    # the lens: layers 0..n x positions, the top token in each cell; bold where it comes next
    page.click('.al-tab[data-view="lens"]')
    assert page.get_attribute(".attnlab-report", "data-view") == "lens"
    cells = page.eval_on_selector_all(".al-lens-cell",
                                      "ts => ts.map(t => [t.dataset.row, t.dataset.pos, t.textContent])")
    assert len(cells) == (L + 1) * T
    assert {(int(r), int(t)): w for r, t, w in cells} == {
        (r, t): e.lens.strings[int(e.lens.ids[r, t, 0])] for r in range(L + 1) for t in range(T)}
    bold = page.eval_on_selector_all(".al-lens-right", "ts => ts.map(t => [+t.dataset.row, +t.dataset.pos])")
    want = [[r, t] for r in range(L + 1) for t in range(T - 1)
            if e.lens.strings[int(e.lens.ids[r, t, 0])] == e.tokens[t + 1]]
    assert sorted(bold) == sorted(want) and len(want) >= L + 1
    tip = _tip_at(page, ".al-stage .al-hit", 2, 5, L + 1, T)
    assert tip.startswith("layer 2 (the output of block 1)\nposition 5 \u201c" + e.tokens[5])
    for k in range(3):
        word, p = e.lens.strings[int(e.lens.ids[2, 5, k])], e.lens.probs[2, 5, k]
        assert f"{k + 1}. \u201c{word}\u201d {p:.3f}" in tip
    assert _tip_at(page, ".al-stage .al-hit", 0, 0, L + 1, T).startswith("layer 0 (the embeddings)")
    session.shot("lens")
    name, svg = session.download(".al-export-svg")
    assert name == "attnlab-lens.svg" and ET.fromstring(svg).tag.endswith("svg")

    # the head detectors: one blocks x heads map per kind; a click opens that head
    page.click('.al-tab[data-view="detectors"]')
    kinds = page.eval_on_selector_all(".al-detector", "gs => gs.map(g => g.dataset.kind)")
    assert kinds == ["previous_token", "duplicate_token", "induction"]
    hit = '.al-detector[data-kind="induction"] .al-hit'
    tip = _tip_at(page, hit, 1, 3, L, H)
    assert "block 1 head 3 (layer 2, head 3)" in tip
    assert f"score {e.head_scores['induction'][1, 3]:.4f}" in tip
    session.shot("detectors")
    name, png = session.download(".al-export-png")
    assert name == "attnlab-detectors.png" and _png_pixels(png)[..., :3].std() > 0.05
    page.click(hit, position={"x": 3.5 * page.locator(hit).bounding_box()["width"] / H,
                              "y": 1.5 * page.locator(hit).bounding_box()["height"] / L})
    assert page.get_attribute(".attnlab-report", "data-view") == "head"
    assert page.input_value(".al-layer") == "1"  # block 1 is layer 2 (the select's value is its index)
    pressed = page.eval_on_selector_all(".al-chip", "cs => cs.map(c => c.ariaPressed)")
    assert pressed == ["false", "false", "false", "true"]

    # patching: blocks x positions, the metric under the pointer
    page.click('.al-tab[data-view="patching"]')
    text = page.inner_text(".al-stage")
    assert "corrupted text: corrupted text" in text and f"{e.tokens[1]}/CHANGED" in text
    assert "logit(\u201cw3\u201d) \u2212 logit(\u201cw4\u201d) at the last position" in text
    tip = _tip_at(page, ".al-stage .al-hit", 2, 7, L, T)
    v = e.patching.values[2, 7]
    assert tip.startswith(f"block 2: the residual entering it (layer 2's output)\nposition 7 \u201c{e.tokens[7]}\u201d")
    shown = float(re.search(r"metric (-?[\d.]+)", tip).group(1))
    assert abs(shown - v) < 1e-3
    assert f"({100 * (v + 0.5) / 3:.0f}% of the way to the clean run)" in tip
    tip = _tip_at(page, ".al-stage .al-hit", 0, 1, L, T)
    assert "(corrupted \u201cCHANGED\u201d)" in tip
    session.shot("patching")
    name, svg = session.download(".al-export-svg")
    assert name == "attnlab-patching.svg" and ET.fromstring(svg).tag.endswith("svg")
    session.check_clean()


def test_new_views_are_off_without_their_data(session, tmp_path):
    page = session.open(rep.write_report(random_explanation(5, 1, 2), tmp_path / "r.html"))
    for view in ("lens", "detectors", "patching"):
        assert page.is_disabled(f'.al-tab[data-view="{view}"]')
    assert "decoders" in page.get_attribute('.al-tab[data-view="lens"]', "title")
    assert "--corrupt" in page.get_attribute('.al-tab[data-view="patching"]', "title")
    session.check_clean()
    session.requests.clear()
    e = inside_explanation(6, 1, 2, patching=False)
    page = session.open(rep.write_report(e, tmp_path / "nopatch.html"))
    assert page.is_disabled('.al-tab[data-view="patching"]') and not page.is_disabled('.al-tab[data-view="lens"]')
    session.check_clean()


def test_the_lens_shows_a_window_of_positions(session, tmp_path):
    e = inside_explanation(150, 2, 2)
    page = session.open(rep.write_report(e, tmp_path / "lens.html"))
    page.click('.al-tab[data-view="lens"]')
    assert page.locator(".al-lens-cell").count() == 3 * 64
    assert page.inner_text(".al-win-info") == "0\u201363 of 150"
    page.click(".al-win-next")
    assert page.inner_text(".al-win-info") == "32\u201395 of 150"
    first = page.eval_on_selector_all(".al-lens-cell", "ts => Math.min(...ts.map(t => +t.dataset.pos))")
    assert first == 32
    name, _ = session.download(".al-export-png")
    assert name == "attnlab-lens-tokens32-95.png"
    page.click('.al-tab[data-view="heatmap"]')  # the other views show every token again
    assert page.locator(".al-win-info").count() == 0
    page.click('.al-tab[data-view="patching"]')
    assert page.locator(".al-win-info").count() == 0
    session.check_clean()


def test_1024_token_decoder_report(session, tmp_path, capsys):
    """The scale case of a decoder: 1024 tokens, 4 blocks x 4 heads, causal maps, with the lens,
    the head detectors and patching; prints the size and timings."""
    e = inside_explanation(1024, 4, 4, vocab=50257)
    path = rep.write_report(e, tmp_path / "decoder.html")
    size = path.stat().st_size
    assert size < 10_000_000
    t0 = time.perf_counter()
    page = session.open(path)
    wall = time.perf_counter() - t0
    times = {}
    for view in ("lens", "detectors", "patching", "model", "heatmap", "head"):
        page.click(f'.al-tab[data-view="{view}"]')
        assert page.locator(".al-stage svg").count() == 1
        times[view] = float(page.get_attribute(".attnlab-report", "data-last-render-ms"))
    session.check_clean()
    with capsys.disabled():
        print(f"\n1024-token decoder report (4x4, causal): {size / 1e6:.2f} MB, open-to-ready {wall * 1000:.0f} ms, "
              f"views (ms): {json.dumps({k: round(v) for k, v in times.items()})}")


def test_a_report_with_fewer_bits_reads_its_weights(session, tmp_path, monkeypatch):
    monkeypatch.setattr(rep, "_SMALL_ATTENTION", 0)
    e = random_explanation(150, 2, 2, sharpness=1.0)
    limit = len(rep.render_html(e).encode()) * 4 // 5
    page = session.open(rep.write_report(e, tmp_path / "small.html", max_bytes=limit))
    foot = page.inner_text(".al-foot")
    bits = int(re.search(r"stored with (\d) bits per value", foot).group(1))
    assert bits < 8
    levels = 2 ** bits - 1
    page.click('.al-tab[data-view="heatmap"]')
    page.click('.al-chip[data-head="1"]')
    tip = _tip_at(page, ".al-stage .al-hit", 5, 3, 150, 150)
    shown = float(re.search(r"weight ([\d.]+)", tip).group(1))
    assert abs(shown - e.attentions[1, 1, 5, 3]) <= e.attentions[1, 1, 5].max() / (2 * levels) + 1e-4
    page.click('.al-tab[data-view="model"]')
    page.click('.al-tab[data-view="head"]')
    assert page.locator(".al-lines path").count() > 0
    session.check_clean()


def test_hostile_strings_in_the_new_views_run_nothing(session, tmp_path):
    e = inside_explanation(6, 1, 2)
    e.lens.strings = {i: (XSS_IMG if i % 2 else XSS_SCRIPT) for i in e.lens.strings}
    e.patching.corrupted_tokens[2] = XSS_IMG
    e.patching.corrupted_text = XSS_SCRIPT
    e.patching.clean_token = XSS_IMG
    page = session.open(rep.write_report(e, tmp_path / "xss-inside.html"))
    for view in ("lens", "detectors", "patching"):
        page.click(f'.al-tab[data-view="{view}"]')
        assert page.locator(".al-stage svg").count() == 1
    text = page.inner_text(".al-stage")
    assert "corrupted text: </script><script>alert(1)</script>" in text and "<img src=x on" in text
    page.click('.al-tab[data-view="lens"]')
    cells = page.inner_text(".al-stage")  # cut to 10 characters, shown as text
    assert "<img src=\u2026" in cells and "</script>\u2026" in cells
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.evaluate("document.querySelectorAll('[onerror]').length") == 0
    session.check_clean()


def test_rollout_view(session, tmp_path):
    T, L = 12, 3
    e = random_explanation(T, L, 2, seed=4)
    a = e.attentions.mean(1) + np.eye(T)  # (L, T, T): heads averaged, the residual added
    a /= a.sum(-1, keepdims=True)
    rollout = [a[0]]
    for i in range(1, L):
        rollout.append(a[i] @ rollout[-1])
    e.rollout = np.stack(rollout)
    page = session.open(rep.write_report(e, tmp_path / "rollout.html"))
    assert page.is_disabled('.al-tab[data-view="lens"]') and not page.is_disabled('.al-tab[data-view="rollout"]')
    page.click('.al-tab[data-view="rollout"]')
    page.eval_on_selector(".al-layer", "s => { s.value = '1'; s.dispatchEvent(new Event('change')); }")  # layer 2
    assert "Attention rollout through layers 1\u20132" in page.inner_text(".al-stage")
    tip = _tip_at(page, ".al-stage .al-hit", 6, 2, T, T)
    assert tip.startswith("token 6 \u201ctok6\u201d after layer 2 draws on input token 2 \u201ctok2\u201d")
    shown = float(re.search(r"rollout ([\d.]+)", tip).group(1))
    assert abs(shown - e.rollout[1, 6, 2]) <= e.rollout[1, 6].max() / 510 + 1e-4
    session.shot("rollout")
    name, svg = session.download(".al-export-svg")
    assert name == "attnlab-rollout-layer2.svg" and ET.fromstring(svg).tag.endswith("svg")
    session.check_clean()
