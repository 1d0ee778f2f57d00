"""The HTML report as text: self-contained, escaped, data round-trips (no browser here)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab.viz
from attnlab.explain import Explanation
from attnlab.viz import html_report as rep
from report_data import XSS_IMG, XSS_SCRIPT, random_explanation, traced_explanation

EVIL_TOKENS = ["hello", XSS_IMG, XSS_SCRIPT, "a&amp;b", '"quoted"', "\u2028line"]


def _data(page: str) -> dict:
    m = re.search(r'<script type="application/json" class="al-data">(.*?)</script>', page, re.S)
    assert m is not None
    return json.loads(m.group(1))


def _arrays(data: dict) -> dict[str, np.ndarray]:
    raw = zlib.decompress(base64.b64decode(data["blob"]))
    out = {}
    for name, ref in data["arrays"].items():
        dtype = {"u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "f32": np.float32}[ref["dtype"]]
        n = int(np.prod(ref["shape"]))
        flat = np.frombuffer(raw, dtype=dtype, count=n, offset=ref["offset"])
        out[name] = flat.reshape(ref["shape"])
    return out


def test_page_is_self_contained():
    page = rep.render_html(traced_explanation(heads=2))
    assert page.startswith("<!DOCTYPE html>")
    # nothing is loaded from anywhere: no external src/href, stylesheet, import or font
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "<link" not in page and "@import" not in page and "url(" not in page
    assert len(re.findall(r"<script\b", page)) == 2  # the JSON data and the program
    assert "<script src" not in page
    assert "fetch(" not in page and "XMLHttpRequest" not in page and "WebSocket" not in page


def test_csp_forbids_fetches_and_allows_only_our_script():
    page = rep.render_html(random_explanation(5, 1, 2))
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page).group(1)
    assert "default-src 'none'" in csp
    script = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert len(script) == 1
    digest = base64.b64encode(hashlib.sha256(script[0].encode()).digest()).decode()
    assert f"'sha256-{digest}'" in csp


@pytest.mark.parametrize("inline", [False, True])
def test_user_text_is_escaped_everywhere(inline):
    e = random_explanation(0, 1, 2, tokens=EVIL_TOKENS, text=f"say {XSS_IMG} {XSS_SCRIPT} & bye",
                           model=f"model {XSS_IMG}")
    e.notes.append(XSS_SCRIPT)
    page = rep.render_html(e, inline=inline)
    assert XSS_IMG not in page and "<img" not in page
    # the only </script> are the two that close our own script elements
    assert page.lower().count("</script") == 2
    assert "&lt;img src=x onerror=alert(1)&gt;" in page  # the header, HTML-escaped
    assert " on" + "error=" not in page.replace("onerror=alert", "")  # no handler attribute
    assert "\u2028" not in page.split("<style>")[0] + _json_blob(page)
    data = _data(page)
    assert data["tokens"] == EVIL_TOKENS
    assert data["model"] == f"model {XSS_IMG}"
    assert data["notes"][-1] == XSS_SCRIPT


def _json_blob(page: str) -> str:
    return re.search(r'class="al-data">(.*?)</script>', page, re.S).group(1)


def test_inline_fragment_for_jupyter():
    e = random_explanation(6, 2, 2)
    frag = rep.render_html(e, inline=True)  # (a notebook shows one view at a time: test_notebook_views)
    assert "<html" not in frag and "<!DOCTYPE" not in frag
    assert ' id="' not in frag  # no ids: several reports can share a notebook
    assert frag.count('class="attnlab-report"') == 1
    assert "<style>" in frag and frag.rstrip().endswith("</script>")
    # the stylesheet is scoped to the report
    css = re.search(r"<style>(.*?)</style>", frag, re.S).group(1)
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    selectors = [s.strip() for rule in re.findall(r"([^{}]+)\{", css) for s in rule.split(",")]
    assert selectors and all(s.startswith(".attnlab-report") for s in selectors), selectors


def test_attention_round_trips_within_quantisation():
    e = random_explanation(17, 3, 4, seed=3)
    data = _data(rep.render_html(e))
    arr = _arrays(data)
    assert (data["T"], data["layers"], data["heads"]) == (17, 3, 4)
    back = arr["attn"].astype(np.float64) / 255 * arr["rowmax"][..., None]
    err = np.abs(back - e.attentions)
    assert np.all(err <= e.attentions.max(-1, keepdims=True) / 510 + 1e-6)
    np.testing.assert_allclose(arr["rowmax"], e.attentions.max(-1), rtol=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(0, 2**31 - 1), st.floats(0.1, 30))
def test_quantize_rows_error_bound(n, seed, sharp):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((3, n)) * sharp
    a = np.exp(logits - logits.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    a[0] = 0.0  # a masked row stays zero
    codes, rowmax = rep.quantize_rows(a)
    back = codes / 255 * rowmax[:, None]
    assert np.all(np.abs(back - a) <= rowmax[:, None] / 510 + 1e-7)
    assert codes[0].max() == 0 and rowmax[0] == 0


def test_trace_is_embedded_in_order_with_shapes():
    e = traced_explanation(heads=2, causal=True)
    data = _data(rep.render_html(e))
    arr = _arrays(data)
    names = [s["name"] for s in data["steps"]]
    for want in ("X", "Q", "K", "V", "scores", "weights", "output"):
        assert want in names
    assert names.index("X") < names.index("Q") < names.index("scores") < names.index("weights")
    first = {(s["name"], s["head"]): s for s in reversed(data["steps"])}
    assert first[("X", None)]["shape"] == [3, 4]
    assert first[("Q", 1)]["shape"] == [3, 3]
    masked = arr[first[("masked_scores", 0)]["array"]]
    assert np.isneginf(masked[0, 1]) and np.isfinite(masked[1, 0])
    np.testing.assert_allclose(arr[first[("weights", 1)]["array"]], e.attentions[0, 1], rtol=1e-6)


def test_trace_adapter_accepts_dicts_objects_and_none():
    steps = rep.trace_steps([{"name": "b", "values": [1.0, 2.0], "head": 0}])
    assert steps[0]["values"].shape == (1, 2) and steps[0]["shape"] == [2] and steps[0]["head"] == 0
    assert rep.trace_steps(None) == []
    assert len(rep.trace_steps(traced_explanation().trace)) > 5
    with pytest.raises(TypeError, match="trace"):
        rep.trace_steps(42)
    with pytest.raises(TypeError, match="step 0"):
        rep.trace_steps([{"values": [1.0]}])
    with pytest.raises(ValueError, match=r"step 0 \('x'\).*1-D or 2-D"):
        rep.trace_steps([{"name": "x", "values": np.zeros((2, 2, 2))}])


def test_no_trace_means_no_steps():
    assert _data(rep.render_html(random_explanation(4, 1, 1)))["steps"] == []


def test_embedding_pca():
    e = random_explanation(9, 1, 1, dim=6)
    emb = _data(rep.render_html(e))["embedding"]
    assert emb["joint"] and len(emb["static"]) == 9 and len(emb["contextual"][0]) == 2
    # the same projection as the PNG (fitted on the static vectors)
    from attnlab.viz.plots import pca_2d
    s2d, c2d = pca_2d(e.static, e.contextual)
    np.testing.assert_allclose(emb["static"], s2d, atol=1e-5)
    np.testing.assert_allclose(emb["contextual"], c2d, atol=1e-5)
    centred = e.static - e.static.mean(0)
    var = np.linalg.svd(centred, compute_uv=False) ** 2
    np.testing.assert_allclose(emb["explained"], var[:2] / var.sum(), atol=1e-4)
    # different widths (single head: X is (3, 4), output (3, 3)): one PCA each
    tut = rep.pca_2d(np.ones((3, 4)) + np.eye(3, 4), np.eye(3))
    assert not tut["joint"] and len(tut["contextual"]) == 3
    # one token: still points, no NaN
    one = rep.pca_2d(np.ones((1, 3)), np.zeros((1, 3)))
    assert np.isfinite(one["static"]).all()


def test_header_states_model_text_and_date():
    e = random_explanation(3, 1, 1, text="the cat sat", model="MiniLM-L6")
    page = rep.render_html(e)
    assert "MiniLM-L6" in page and "the cat sat" in page and e.created in page


def test_write_report_and_viz_report(tmp_path):
    e = random_explanation(5, 2, 3)
    p = attnlab.viz.report(e, tmp_path / "a.html")
    assert p == tmp_path / "a.html" and p.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    q = rep.write_report(e, str(tmp_path / "b.html"))
    assert q.exists() and attnlab.viz.write_report(e, tmp_path / "c.html").exists()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.html", "b.html", "c.html"]


def test_write_report_leaves_nothing_half_written(tmp_path):
    bad = random_explanation(4, 1, 1)
    bad.attentions = bad.attentions * 3
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        rep.write_report(bad, tmp_path / "r.html")
    with pytest.raises(OSError):
        rep.write_report(random_explanation(4, 1, 1), tmp_path / "missing" / "r.html")
    assert list(tmp_path.iterdir()) == []


def _explanation(**changes):
    e = random_explanation(4, 1, 2)
    for k, v in changes.items():
        setattr(e, k, v)
    return e


@pytest.mark.parametrize(
    "changes, error, match",
    [
        ({"tokens": []}, ValueError, "tokens is empty"),
        ({"tokens": ["a", 1, "b", "c"]}, TypeError, "list of str"),
        ({"tokens": "abcd"}, TypeError, "list of str"),
        ({"attentions": np.full((2, 4, 4), 0.25)}, ValueError, r"\(layers, heads, 4, 4\)"),
        ({"attentions": np.full((1, 1, 4, 5), 0.2)}, ValueError, r"has shape \(1, 1, 4, 5\)"),
        ({"attentions": np.full((1, 1, 4, 4), np.nan)}, ValueError, "NaN"),
        ({"attentions": np.full((1, 1, 4, 4), -0.5)}, ValueError, r"\[0, 1\]"),
        ({"attentions": np.array([[[["a"] * 4] * 4]])}, TypeError, "attentions"),
        ({"static": np.zeros((3, 2))}, ValueError, r"static has shape \(3, 2\).*\(4, D\)"),
        ({"contextual": np.zeros(4)}, ValueError, "contextual"),
        ({"contextual": np.full((4, 2), np.inf)}, ValueError, "contextual contains NaN"),
        ({"trace": 3.5}, TypeError, "trace"),
    ],
)
def test_bad_explanations_raise_one_clear_error(changes, error, match):
    with pytest.raises(error, match=match):
        rep.render_html(_explanation(**changes))


def test_not_an_explanation():
    with pytest.raises(TypeError, match="Explanation"):
        rep.render_html({"tokens": ["a"]})


def test_large_report_stays_small():
    """256 tokens x 6 layers x 12 heads: 4.7M weights in a few MB (generous bound)."""
    e = random_explanation(256, 6, 12, dim=64)
    page = rep.render_html(e)
    assert len(page.encode()) < 8 * 2**20
    assert isinstance(e, Explanation)


def test_any_token_text_can_be_written(tmp_path):
    """Lone surrogates (which no file can encode) become U+FFFD; a surrogate pair becomes
    its character; XML-forbidden controls stay data in the JSON and are shown as control
    pictures in the header."""
    tokens = ["lone\ud800", "\ud83d\ude00", "nul\x00", "bell\x07", "\ufffe"]
    e = random_explanation(0, 1, 1, tokens=tokens, text="text\udc00\x01", model="m\ud83d")
    path = rep.write_report(e, tmp_path / "r.html")
    page = path.read_text(encoding="utf-8")
    data = _data(page)
    assert data["tokens"] == ["lone\ufffd", "😀", "nul\x00", "bell\x07", "\ufffe"]
    assert data["text"] == "text\ufffd\x01" and data["model"] == "m\ufffd"
    header = re.search(r'<header class="al-head">.*?</header>', page, re.S).group(0)
    assert "text\ufffd\u2401" in header and "\x01" not in header
    assert "\x00" not in page and "\x07" not in page  # only as JSON escapes


def test_long_texts_warn_and_are_drawn_a_window_at_a_time():
    e = random_explanation(rep.LONG_INPUT + 1, 1, 1, dim=4)
    with pytest.warns(UserWarning, match=f"{rep.LONG_INPUT + 1} tokens: the browser shows {rep.WINDOW}"):
        data = _data(rep.render_html(e))
    assert data["window"] == rep.WINDOW
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _data(rep.render_html(random_explanation(rep.LONG_INPUT, 1, 1, dim=4)))["window"] is None


# ---- the size target: fewer bits per attention weight when 8 would pass it -----------------------


def test_a_report_that_would_be_too_large_gets_fewer_bits(monkeypatch):
    monkeypatch.setattr(rep, "_SMALL_ATTENTION", 0)  # as for a long text, on a small one
    e = random_explanation(160, 2, 3, sharpness=1.0)
    full = rep.render_html(e)
    assert _data(full)["levels"] == 255
    limit = len(full.encode()) * 2 // 3
    page = rep.render_html(e, max_bytes=limit)
    data = _data(page)
    levels = data["levels"]
    assert len(page.encode()) <= limit and levels in rep.CODE_LEVELS and levels < 255
    bits = levels.bit_length()
    assert f"attention weights stored with {bits} bits (instead of 8)" in " ".join(data["notes"])
    arr = _arrays(data)
    assert arr["rowmax"].dtype == np.uint16  # in units of 1/65535
    rowmax = arr["rowmax"] / 65535
    np.testing.assert_allclose(rowmax, e.attentions.max(-1), atol=0.5 / 65535 + 1e-7, rtol=0)
    back = arr["attn"] / levels * rowmax[..., None]
    assert np.all(np.abs(back - e.attentions) <= rowmax[..., None] / (2 * levels) + 1e-4)
    # the largest code range that fits is chosen: one more level would not have fitted
    if levels != rep.CODE_LEVELS[0]:
        bigger = rep.CODE_LEVELS[rep.CODE_LEVELS.index(levels) - 1]
        monkeypatch.setattr(rep, "CODE_LEVELS", (bigger, bigger))
        with pytest.warns(UserWarning, match="even with"):
            assert len(rep.render_html(e, max_bytes=limit).encode()) > limit


def test_a_report_that_cannot_fit_says_so(monkeypatch):
    monkeypatch.setattr(rep, "_SMALL_ATTENTION", 0)
    e = random_explanation(60, 1, 2)
    with pytest.warns(UserWarning, match=r"the report is 0\.\d MB, more than 0\.01 MB, even with 2-bit attention"):
        page = rep.render_html(e, max_bytes=10_000)
    data = _data(page)
    assert data["levels"] == 3
    assert ("attention weights stored with 2 bits (instead of 8) relative to each row's maximum, the fewest offered "
            "(the report is still more than 0.01 MB): each weight within 17% of its row's maximum") in data["notes"]


def test_small_reports_keep_8_bits_and_float_row_maxima():
    data = _data(rep.render_html(random_explanation(30, 2, 2), max_bytes=1000))
    assert data["levels"] == 255 and data["arrays"]["rowmax"]["dtype"] == "f32"
