"""attnlab.viz.plots: what the figures contain, and the files they save."""

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="matplotlib (the viz extra) is not installed")

from attnlab.explain import random_model as explain_random  # noqa: E402
from attnlab.viz.plots import (  # noqa: E402
    pca_2d,
    plot_attention,
    plot_embeddings,
    plot_heads,
    plot_training_curves,
    spread_labels,
)

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


def test_pca_is_fitted_on_the_static_vectors():
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


def _label_boxes(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    return [(t.get_text(), t.get_window_extent(renderer)) for ax in fig.axes for t in ax.texts
            if t.get_gid() == "token-label"]


def test_embedding_labels_never_overprint_even_when_points_nearly_coincide():
    """Two contextual points 1e-3 apart ("the" and "[SEP]", as MiniLM puts them), static
    points close together: every point keeps a label and no two labels overlap."""
    tokens = ["[CLS]", "the", "cat", "sat", "on", "the", "mat", "[SEP]"]
    static = np.array([[1.1, 0.9], [0.2, -0.52], [-0.7, 0.44], [-0.73, 0.11], [0.1, -0.36],
                       [0.2, -0.52], [-0.55, 0.37], [0.36, -0.42]])
    contextual = np.array([[1.7, 2.4], [-0.55, -0.71], [-1.7, 1.28], [-2.7, 0.5], [-0.8, -1.24],
                           [-0.72, -0.97], [-1.53, 1.48], [-0.721, -0.971]])
    pad = np.zeros((8, 3))  # D = 5; PCA keeps the two used directions
    fig = plot_embeddings(np.hstack([static, pad]), np.hstack([contextual, pad]), tokens)
    boxes = _label_boxes(fig)
    assert sorted(t for t, _ in boxes) == sorted(
        ["[CLS]", "the ×2", "cat", "sat", "on", "mat", "[SEP]"]  # static
        + ["[CLS]", "the", "cat", "sat", "on", "the", "mat", "[SEP]"])  # contextual
    for i, (ta, a) in enumerate(boxes):
        for tb, b in boxes[i + 1:]:
            assert not a.overlaps(b), f"{ta!r} overprints {tb!r}"


def test_spread_labels_moves_only_what_collides():
    anchors = np.array([[0.0, 0.0], [100.0, 0.0], [101.0, 0.0]])
    boxes = spread_labels(anchors, np.full((3, 2), [20.0, 8.0]))
    assert boxes[:2, 2].tolist() == [1, 1]  # alone: right beside its point
    x0, y0 = boxes[2, :2]
    first = boxes[1]
    assert x0 + 20 <= first[0] or x0 >= first[0] + 20 or y0 + 8 <= first[1] or y0 >= first[1] + 8
    bounded = spread_labels(np.array([[5.0, 5.0]]), np.array([[20.0, 8.0]]), bounds=(0, 0, 30, 30))
    assert bounded[0, 0] >= 0 and bounded[0, 0] + 20 <= 30  # stays inside


def test_training_curves(tmp_path):
    history = {"step": [1, 2, 3, 4], "loss": [3.0, 2.0, 1.0, 0.5], "accuracy": [0.0, 0.2, 0.6, 0.9]}
    fig = plot_training_curves(history, [{"step": 4, "loss": 0.6, "accuracy": 0.85}],
                               title="run", path=tmp_path / "c.png")
    loss, acc = fig.axes
    assert loss.get_yscale() == "log" and [line.get_label() for line in loss.lines] == [
        "train (batch)", "held-out"]
    np.testing.assert_array_equal(acc.lines[0].get_ydata(), history["accuracy"])
    assert _png_size(tmp_path / "c.png")[0] > 500
    with pytest.raises(ValueError, match=r"history\['loss'\] has 1 values for 4 steps"):
        plot_training_curves({**history, "loss": [1.0]})
