"""attnlab.viz.plots: what the figures contain, and the files they save."""

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="matplotlib (the viz extra) is not installed")

from attnlab.explain import random_model as explain_random  # noqa: E402
from attnlab.viz.plots import pca_2d, plot_attention, plot_embeddings, plot_heads  # noqa: E402

TOKENS = ["the", "cat", "sat", "on", "the", "mat"]


@pytest.fixture(scope="module")
def expl():
    return explain_random("The cat sat on the mat", seed=0)


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_heatmap_has_token_labels_title_and_colorbar(expl, tmp_path):
    fig = plot_attention(expl.attentions[0, 0], expl.tokens, title="head 0",
                         path=tmp_path / "h.png")
    ax, cbar = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == TOKENS
    assert [t.get_text() for t in ax.get_yticklabels()] == TOKENS
    assert ax.get_title() == "head 0"
    assert cbar.get_ylabel() == "attention weight"
    np.testing.assert_allclose(ax.images[0].get_array(), expl.attentions[0, 0])
    assert len(ax.texts) == 36  # every cell annotated for a short sentence
    w, h = _png_size(tmp_path / "h.png")
    assert 400 <= w <= 3000 and 400 <= h <= 3000


def test_heads_grid(expl, tmp_path):
    fig = plot_heads(expl.attentions[0], expl.tokens, path=tmp_path / "g.svg")
    heat = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in heat] == ["head 0", "head 1", "head 2", "head 3"]
    assert all([t.get_text() for t in ax.get_xticklabels()] == TOKENS for ax in heat)
    assert len(fig.axes) == 5  # four heads and a colorbar
    assert (tmp_path / "g.svg").read_text().lstrip().startswith("<?xml")


def test_heads_grid_hides_empty_cells():
    fig = plot_heads(np.full((12, 3, 3), 1 / 3), ["a", "b", "c"])
    visible = [ax for ax in fig.axes if ax.get_visible() and ax.images]
    assert len(visible) == 12


def test_embeddings_plot_has_an_arrow_per_token(expl, tmp_path):
    fig = plot_embeddings(expl.static, expl.contextual, expl.tokens, path=tmp_path / "e.png")
    ax = fig.axes[0]
    arrows = [p for p in ax.patches if p.get_gid() == "token-arrow"]
    assert len(arrows) == 6
    assert len(ax.collections) == 2  # static and contextual scatter
    labels = [t.get_text() for t in ax.texts]
    assert "the ×2" in labels  # equal words share a label
    assert "PCA" in ax.get_xlabel() and "PCA" in ax.get_ylabel()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "static (before attention)", "contextual (after attention)"]
    w, h = _png_size(tmp_path / "e.png")
    assert 600 <= w <= 3000 and 600 <= h <= 3000


def test_pca_is_fitted_on_static_like_seed_000():
    rng = np.random.default_rng(0)
    s, c = rng.standard_normal((6, 10)), rng.standard_normal((6, 10))
    s2, c2 = pca_2d(s, c)
    centred = s - s.mean(0)
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    np.testing.assert_allclose(np.abs(s2), np.abs(centred @ vt[:2].T), atol=1e-12)
    np.testing.assert_allclose(np.abs(c2), np.abs((c - s.mean(0)) @ vt[:2].T), atol=1e-12)
    one, = pca_2d(np.ones((1, 4)))
    assert one.shape == (1, 2) and (one == 0).all()


def test_plots_reject_bad_input(tmp_path):
    with pytest.raises(ValueError, match="should be"):
        plot_attention(np.ones(3))
    with pytest.raises(ValueError, match="labels"):
        plot_attention(np.ones((2, 2)), ["a"])
    with pytest.raises(ValueError, match=".png or .svg"):
        plot_attention(np.ones((2, 2)), path=tmp_path / "x.jpg")
    with pytest.raises(ValueError, match="should be"):
        plot_embeddings(np.ones((3, 4)), np.ones((3, 5)), list("abc"))
