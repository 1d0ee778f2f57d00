"""``attnlab attribute``, ``attnlab explain --attribute`` and the report's three attribution
tabs (input attribution, AtP beside activation patching, the circuit), on a random-weight
GPT-2 folder run in-process; the tabs in Debian's Chromium."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnlab.cli import main
from attnlab.explain import explain
from attnlab.viz import html_report as rep
from helpers import random_gpt2

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    random_gpt2(path, seed=2, n_layer=2, n_head=2, n_embd=16, vocab_size=40)
    return path


def test_explain_attribute_computes_and_prints_all_three(folder, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    html = tmp_path / "r.html"
    code = main(["explain", "1 2 3 4 5 6", "--model", "gpt2", "--checkpoint", str(folder), "--corrupt",
                 "1 2 9 4 5 6", "--attribute", "--html", str(html)])
    assert code == 0
    out = capsys.readouterr().out
    assert "input attribution: integrated gradients (32 Gauss-Legendre points, zeros baseline)" in out
    assert "attribution patching (resid_pre, the gradient at the corrupted run" in out
    assert "circuit (EAP-IG, 5 points):" in out and "faithfulness" in out
    assert "\x1b[" not in out  # NO_COLOR: no escape codes
    e = explain("1 2 3 4 5 6", model="gpt2", path=str(folder), corrupt="1 2 9 4 5 6", attribute=True)
    a = e.attribution
    assert a.scores.shape == (6,) and a.atp.shape == (2, 6) and a.atp_clean.shape == (2, 6)
    assert abs(a.gap) <= 1e-3 * abs(a.value - a.baseline_value)
    assert a.circuit.edges and a.circuit.edges_scored == 46
    d = e.to_dict()
    assert d["version"] == 5 and d["attribution"]["target"]["id"] == a.target_id
    assert d["attribution"]["atp"]["shape"] == [2, 6] and len(d["attribution"]["circuit"]["edges"]) == len(
        a.circuit.edges)
    json.dumps(d, allow_nan=False)
    assert explain("1 2 3", model="gpt2", path=str(folder)).to_dict()["attribution"] is None


def test_explain_attribute_needs_a_decoder(capsys):
    assert main(["explain", "a b c", "--model", "random", "--attribute"]) == 2
    assert "--attribute needs a decoder" in capsys.readouterr().err


def test_attribute_command_text_json_and_colour(folder, capsys, monkeypatch):
    from attnlab.models import from_pretrained

    model = from_pretrained(folder)
    monkeypatch.setattr("attnlab.models.from_pretrained", lambda path: model)
    model.tokenizer = _DigitTokenizer()
    monkeypatch.setenv("NO_COLOR", "1")
    assert main(["attribute", "1 2 3 4", "--model", "gpt2", "--checkpoint", str(folder), "--target", "7"]) == 0
    out = capsys.readouterr().out
    assert "integrated gradients (50 gausslegendre points)" in out and "log_prob of '7'" in out
    assert "completeness gap" in out and "'3'" in out
    assert main(["attribute", "1 2 3 4", "--model", "gpt2", "--checkpoint", "x", "--target", "7 8",
                 "--method", "saliency", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [len(r["scores"]) for r in doc["rows"]] == [4, 5] and doc["method"] == "saliency"
    monkeypatch.delenv("NO_COLOR")
    monkeypatch.setattr("attnlab.cli.attribute.use_color", lambda stream: True)
    assert main(["attribute", "1 2 3 4", "--model", "gpt2", "--checkpoint", "x", "--target", "7"]) == 0
    assert "\x1b[48;5;" in capsys.readouterr().out
    assert main(["attribute", "1 2 3 4", "--model", "gpt2", "--checkpoint", "x", "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    assert main(["attribute", "1 2 3 4", "--model", "gpt2", "--checkpoint", "x", "--target", "99"]) == 2
    assert "is outside the vocabulary" in capsys.readouterr().err


class _DigitTokenizer:
    """Space-separated ids as tokens (what a tokenizer gives the command)."""

    class _Enc:
        def __init__(self, text):
            self.ids = [int(w) for w in text.split()]
            self.tokens = text.split()

    def encode(self, text):
        return self._Enc(text)

    def decode(self, ids):
        return " ".join(str(i) for i in ids)

    def id_to_token(self, i):
        return str(i)


def test_format_tokens_with_and_without_colour():
    from attnlab.cli.attribute import format_tokens

    plain = format_tokens(["Ġthe", "Ġcat"], [1.0, -0.5], color=False)
    assert plain.splitlines() == ["  ' the'  +1.000  ++++++++++", "  ' cat'  -0.500  -----"]
    coloured = format_tokens(["a", "b"], [1.0, -1.0], color=True)
    assert coloured == "\x1b[48;5;196m\x1b[38;5;16ma\x1b[0m\x1b[48;5;33m\x1b[38;5;16mb\x1b[0m"


def test_report_payload_holds_the_attribution(folder):
    e = explain("1 2 3 4 5 6", model="gpt2", path=str(folder), corrupt="1 2 9 4 5 6", attribute=True)
    data = rep._payload(e)
    a = data["attribution"]
    assert a["atp"] is True and a["circuit"]["edges_scored"] == 46
    assert a["target_token"] == e.attribution.target_token
    e.attribution.scores = np.zeros(3)
    with pytest.raises(ValueError, match=r"explanation.attribution.scores has shape \(3,\), but should be \(6,\)"):
        rep._payload(e)


def test_the_three_tabs_in_the_browser(folder, tmp_path):
    from browser import launch, sync_api_or_skip

    sync_api = sync_api_or_skip()
    e = explain("1 2 3 4 5 6", model="gpt2", path=str(folder), corrupt="1 2 9 4 5 6", attribute=True)
    path = rep.write_report(e, tmp_path / "r.html")
    plain = rep.write_report(explain("1 2 3", model="gpt2", path=str(folder)), tmp_path / "plain.html")
    errors = []
    with sync_api.sync_playwright() as p:
        b = launch(p)
        page = b.new_page(viewport={"width": 1280, "height": 900})
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.goto(path.resolve().as_uri())
        page.wait_for_selector(".attnlab-report[data-ready]", timeout=30_000)
        page.click('.al-tab[data-view="attribution"]')
        tokens = page.eval_on_selector_all(".al-attr-token", "gs => gs.map(g => g.textContent)")
        assert tokens == e.tokens
        box = page.locator('.al-attr-token[data-token="2"] rect').bounding_box()
        page.mouse.move(box["x"] + 3, box["y"] + 3)
        assert f"score {e.attribution.scores[2]:.3f}"[:12] in page.inner_text(".al-tip")
        page.click('.al-tab[data-view="atp"]')
        hits = page.locator(".al-stage .al-hit")
        assert hits.count() == 2
        box = hits.nth(1).bounding_box()
        page.mouse.move(box["x"] + 2.5 * box["width"] / 6, box["y"] + 0.5 * box["height"] / 2)
        tip = page.inner_text(".al-tip")
        want = e.attribution.atp[0, 2]
        assert tip.startswith("block 0, position 2") and abs(float(tip.split("AtP ")[1]) - want) < 1e-3
        page.click('.al-tab[data-view="circuit"]')
        assert page.locator(".al-edge").count() == len(e.attribution.circuit.edges)
        nodes = page.eval_on_selector_all(".al-node", "gs => gs.map(g => g.dataset.node)")
        assert "input" in nodes and "logits" in nodes
        page.goto(plain.resolve().as_uri())
        page.wait_for_selector(".attnlab-report[data-ready]", timeout=30_000)
        for view in ("attribution", "atp", "circuit"):
            assert page.is_disabled(f'.al-tab[data-view="{view}"]')
        b.close()
    assert errors == []
