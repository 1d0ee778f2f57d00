"""Pictures of attention: a heatmap, a grid of heads, static -> contextual embeddings, and
the curves of a training run.

matplotlib (the ``viz`` extra) is imported inside each function, with the Agg backend
(no display needed). Each function returns the ``Figure`` and, given ``path``, saves it as
PNG or SVG (chosen by the suffix).

Shapes: ``H`` heads, ``L`` query tokens, ``S`` key tokens, ``T`` tokens, ``D`` width.
"""

from __future__ import annotations

import contextlib
import math
import os
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from attnlab._validation import shape_error

_FORMATS = {".png": "png", ".svg": "svg"}
STATIC_COLOR = "#1f77b4"
CONTEXT_COLOR = "#d62728"


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'attnlab[viz]'") from exc
    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    return Figure


def save_figure(fig, path: str | os.PathLike, *, dpi: int = 150) -> Path:
    """Save ``fig`` as PNG or SVG according to ``path``'s suffix; returns the path.

    matplotlib's own "Glyph ... missing" warnings are not shown: the plot functions have
    already said, once, which characters no installed font can draw (:func:`font_families`).
    """
    path = Path(path)
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"path must end in .png or .svg, got {str(path)!r}")
    with _no_glyph_warnings():
        fig.savefig(path, format=fmt, dpi=dpi)  # constrained layout already fits the labels
    return path


@contextlib.contextmanager
def _no_glyph_warnings():
    """matplotlib's "Glyph ... missing" warnings are left out (:func:`_use_fonts` says it once)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from")
        yield


# Fonts that have a glyph for every character but draw it as a placeholder, and math fonts.
_NOT_TEXT_FONTS = ("Last Resort", "STIX", "cm", "DejaVu Math")


def _charmap(path: str) -> frozenset[int]:
    return _CHARMAPS.get(path) or _CHARMAPS.setdefault(path, _read_charmap(path))


def _read_charmap(path: str) -> frozenset[int]:
    from matplotlib.ft2font import FT2Font

    try:
        return frozenset(FT2Font(path).get_charmap())
    except (OSError, RuntimeError, ValueError):
        return frozenset()


_CHARMAPS: dict[str, frozenset[int]] = {}


def font_families(texts: Sequence[str]) -> tuple[list[str], list[str]]:
    """The font families that draw ``texts``: matplotlib's default sans-serif font first, then
    installed fonts (found by matplotlib's font manager) for the characters it lacks.

    Returns:
        ``(families, missing)``: the families for ``font.family`` (matplotlib falls back
        from one to the next, character by character) and the characters no installed font
        has (drawn as boxes).

    >>> font_families(["cat", "sat"])[1]
    []
    """
    from matplotlib import font_manager, rcParams

    default = font_manager.findfont(font_manager.FontProperties(family=rcParams["font.family"]))
    first = font_manager.get_font(default).family_name
    chars = {c for t in texts for c in str(t)  # not controls, format marks, surrogates, spaces
             if ord(c) > 0x7E and not c.isspace() and unicodedata.category(c) not in ("Cc", "Cf", "Cs")}
    missing = {c for c in chars if ord(c) not in _charmap(default)}
    if not missing:
        return [first], []
    manager = font_manager.fontManager
    known = {f.fname for f in manager.ttflist}
    for path in font_manager.findSystemFonts():  # installed after matplotlib cached its list
        if path not in known and path.lower().endswith((".ttf", ".otf", ".ttc")):
            try:
                manager.addfont(path)
            except (OSError, RuntimeError, ValueError):
                pass
    families = [first]
    candidates = {}
    for entry in manager.ttflist:
        if entry.name.startswith(_NOT_TEXT_FONTS) or entry.style != "normal" or entry.name in candidates:
            continue
        candidates[entry.name] = entry.fname
    while missing:
        scores = {name: len({c for c in missing if ord(c) in _charmap(path)}) for name, path in candidates.items()}
        best = max(scores, key=lambda n: (scores[n], "Sans" in n, "Mono" not in n, n), default=None)
        if best is None or scores[best] == 0:
            break
        families.append(best)
        cover = _charmap(candidates.pop(best))
        missing = {c for c in missing if ord(c) not in cover}
    return families, sorted(missing)




def _labels(tokens: Sequence[str] | None, n: int, name: str) -> list[str]:
    if tokens is None:
        return [str(i) for i in range(n)]
    tokens = [str(t) for t in tokens]
    if len(tokens) != n:
        raise ValueError(f"{name} has {len(tokens)} labels, but the weights need {n}")
    return tokens


def _check_weights(weights, ndim: int, layout: str) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != ndim:
        raise shape_error("weights", w.shape, layout)
    return w


def _use_fonts(fig, texts: Sequence[str]) -> None:
    """Draw every text of ``fig`` with fonts that have its characters (:func:`font_families`);
    warn once, in one line, about characters no installed font has."""
    import warnings

    from matplotlib.text import Text

    families, missing = font_families(texts)
    if missing and frozenset(missing) not in _SAID:  # once per set of characters, not per picture
        _SAID.add(frozenset(missing))
        shown = " ".join(missing[:8]) + (" …" if len(missing) > 8 else "")
        cjk = any(unicodedata.name(c, "").startswith(("CJK", "HIRAGANA", "KATAKANA", "HANGUL")) for c in missing)
        hint = " (Debian's fonts-noto-cjk has Chinese, Japanese and Korean)" if cjk else ""
        warnings.warn(f"the pictures cannot draw {len(missing)} character(s) of the labels ({shown}): no "
                      f"installed font has them, so they show as boxes{hint}", UserWarning, stacklevel=3)
    if len(families) > 1:
        for t in fig.findobj(Text):
            t.set_fontfamily(families)


_SAID: set[frozenset[str]] = set()


def tick_step(n: int, length_pt: float, fontsize: float) -> int:
    """Label every ``k``-th of ``n`` ticks so that labels ``fontsize`` points high, on an
    axis ``length_pt`` points long, never overprint each other.

    >>> tick_step(10, 500, 10), tick_step(256, 800, 7)
    (1, 3)
    """
    fit = max(1, int(length_pt // (1.25 * fontsize)))
    return max(1, math.ceil(n / fit))


def _ordinal(k: int) -> str:
    return {2: "2nd", 3: "3rd"}.get(k, f"{k}th")


def _draw_heatmap(ax, w, rows, cols, *, annotate: bool, vmax: float, fontsize: float,
                  step: int = 1, xlabels: bool = True, ylabels: bool = True):
    """One head's map; only every ``step``-th token is labelled (said in the axis labels)."""
    im = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto", interpolation="nearest")
    left_out = "" if step == 1 else f" (every {_ordinal(step)} labelled)"
    if xlabels:
        xs = range(0, len(cols), step)
        ax.set_xticks(xs, [cols[j] for j in xs], rotation=45, ha="right", rotation_mode="anchor",
                      fontsize=fontsize)
        ax.set_xlabel("attends to (key)" + left_out, fontsize=fontsize)
    else:
        ax.set_xticks([])
    if ylabels:
        ys = range(0, len(rows), step)
        ax.set_yticks(ys, [rows[i] for i in ys], fontsize=fontsize)
        ax.set_ylabel("token (query)" + left_out, fontsize=fontsize)
    else:
        ax.set_yticks([])
    if annotate:
        for i in range(w.shape[0]):
            for j in range(w.shape[1]):
                light = w[i, j] < 0.6 * vmax
                ax.text(j, i, f"{w[i, j]:.2f}", ha="center", va="center", in_layout=False,
                        fontsize=fontsize * 0.85, color="white" if light else "black")
    return im


def plot_attention(
    weights: np.ndarray,
    tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    *,
    title: str | None = None,
    annotate: bool | None = None,
    path: str | os.PathLike | None = None,
):
    """A heatmap of one head's weights ``(L, S)``: rows are queries, columns keys.

    Args:
        weights: ``(L, S)``, each row summing to 1.
        tokens: ``L`` row labels (and column labels when ``key_tokens`` is None).
        key_tokens: ``S`` column labels.
        title: the figure's title.
        annotate: print each value in its cell (default: when ``L, S <= 16``).
        path: save there (``.png`` or ``.svg``).

    Returns:
        The matplotlib ``Figure`` (one heatmap axes and a colorbar).

    >>> fig = plot_attention(np.full((3, 3), 1 / 3), ["a", "b", "c"], title="uniform")
    >>> [t.get_text() for t in fig.axes[0].get_xticklabels()]
    ['a', 'b', 'c']
    """
    Figure = _pyplot()
    w = _check_weights(weights, 2, "(L, S)")
    L, S = w.shape
    rows = _labels(tokens, L, "tokens")
    cols = _labels(key_tokens if key_tokens is not None else (tokens if L == S else None), S,
                   "key_tokens")
    if annotate is None:
        annotate = max(L, S) <= 16
    side = min(14.0, max(4.5, 0.55 * max(L, S) + 2.5))
    fig = Figure(figsize=(side + 1.2, side), layout="constrained")
    ax = fig.add_subplot()
    fontsize = 11 if max(L, S) <= 20 else max(7, 11 - (max(L, S) - 20) // 8)
    step = tick_step(max(L, S), 0.75 * side * 72, fontsize)
    vmax = max(float(w.max(initial=0)), 1e-9)
    im = _draw_heatmap(ax, w, rows, cols, annotate=annotate, vmax=vmax, fontsize=fontsize, step=step)
    cbar = fig.colorbar(im, ax=ax, shrink=0.8)
    cbar.set_label("attention weight")
    ax.set_title(title or "Attention weights", fontsize=13)
    _use_fonts(fig, [*rows, *cols, title or ""])
    if path is not None:
        save_figure(fig, path)
    return fig


def plot_heads(
    attentions: np.ndarray,
    tokens: Sequence[str] | None = None,
    *,
    title: str | None = None,
    head_labels: Sequence[str] | None = None,
    path: str | os.PathLike | None = None,
):
    """A grid of heatmaps, one per head, with token labels and one shared colorbar.

    Args:
        attentions: ``(H, L, S)`` weights of one layer.
        tokens: ``L`` (= ``S``) labels.
        title: the figure's title.
        head_labels: ``H`` subplot titles (default "head 0", ...).
        path: save there (``.png`` or ``.svg``).

    Returns:
        The ``Figure``: ``H`` heatmap axes (then empty grid cells hidden) and a colorbar.

    >>> fig = plot_heads(np.full((4, 3, 3), 1 / 3), ["a", "b", "c"])
    >>> [ax.get_title() for ax in fig.axes[:4]]
    ['head 0', 'head 1', 'head 2', 'head 3']
    """
    Figure = _pyplot()
    w = _check_weights(attentions, 3, "(H, L, S)")
    H, L, S = w.shape
    if H == 0:
        raise shape_error("attentions", w.shape, "(H, L, S) with H >= 1")
    rows = _labels(tokens, L, "tokens")
    cols = rows if L == S else [str(i) for i in range(S)]
    titles = list(head_labels) if head_labels is not None else [f"head {h}" for h in range(H)]
    if len(titles) != H:
        raise ValueError(f"head_labels has {len(titles)} entries, but there are {H} heads")
    ncols = min(H, 4) if H <= 8 else math.ceil(math.sqrt(H))
    nrows = math.ceil(H / ncols)
    cell = min(4.2, max(2.6, 0.3 * max(L, S) + 1.2))
    n = max(L, S)
    fontsize = 9 if n <= 12 else max(6, 9 - (n - 12) // 6)
    step = tick_step(n, 0.95 * cell * 72, fontsize)
    if step > 1:  # the labelled tokens only
        rows_shown = rows[::step]
        cols_shown = cols[::step]
    else:
        rows_shown, cols_shown = rows, cols
    title = title or f"Attention weights of {H} heads"
    # The margins are computed, not found by constrained layout, which costs about a second
    # on a 12-head grid: labels (about 0.62 em a character; x labels at 45 degrees), then the
    # axis titles, the head titles, the figure title and the colorbar.
    char = 0.62 * fontsize / 72
    row_w = max(len(r) for r in rows_shown) * char
    col_h = max(len(c) for c in cols_shown) * char * 0.72
    left = max(row_w + 0.12, col_h) + 0.45
    bottom, right = col_h + 0.5, 1.15
    top = 0.3 * (title.count("\n") + 1) + 0.45
    wgap, hgap = 0.15, 0.4
    width = left + ncols * cell + (ncols - 1) * wgap + right
    height = bottom + nrows * cell + (nrows - 1) * hgap + top
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(left=left / width, right=1 - right / width, bottom=bottom / height,
                        top=1 - top / height, wspace=wgap / cell, hspace=hgap / cell)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    vmax = max(float(w.max(initial=0)), 1e-9)
    annotate = n <= 8 and H <= 4  # values in every cell of a bigger grid cost seconds to draw
    im = None
    for h in range(nrows * ncols):
        ax = axes[h // ncols][h % ncols]
        if h >= H:
            ax.set_visible(False)
            continue
        # token labels on the outer edges only (inner axes get no ticks at all: fast)
        im = _draw_heatmap(ax, w[h], rows, cols, annotate=annotate, vmax=vmax, fontsize=fontsize,
                           step=step, xlabels=h + ncols >= H, ylabels=h % ncols == 0)
        ax.set_title(titles[h], fontsize=11)
    grid = nrows * cell + (nrows - 1) * hgap
    cax = fig.add_axes(((width - right + 0.25) / width, (bottom + 0.2 * grid) / height,
                        0.18 / width, 0.6 * grid / height))
    cbar = fig.colorbar(im, cax=cax)
    cbar.set_label("attention weight")
    fig.suptitle(title, fontsize=13, y=1 - 0.1 / height, va="top")
    _use_fonts(fig, [*rows, *cols, title, *titles])
    if path is not None:
        save_figure(fig, path)
    return fig


def pca_fit(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The two principal axes of ``x`` ``(T, D)`` by NumPy's SVD (no scikit-learn).

    Each axis gets a deterministic sign (its largest-magnitude entry is positive); with
    fewer than two directions of variance the missing axes are 0.

    Returns:
        ``(mean (D,), axes (2, D), explained (2,))``: ``explained`` is each axis's share
        of the variance.

    >>> mean, axes, explained = pca_fit(np.array([[0., 0], [2, 0], [0, 1]]))
    >>> axes.shape, bool(explained[0] > explained[1])
    ((2, 2), True)
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise shape_error("x", x.shape, "(T, D)")
    mean = x.mean(axis=0)
    _, sv, vt = np.linalg.svd(x - mean, full_matrices=False)
    axes = np.zeros((2, x.shape[1]))
    k = min(2, vt.shape[0])
    axes[:k] = vt[:k]
    signs = np.sign(axes[np.arange(2), np.abs(axes).argmax(axis=1)])
    axes *= np.where(signs == 0, 1.0, signs)[:, None]
    var = sv**2
    explained = np.zeros(2)
    if var.sum() > 0:
        explained[:k] = var[:k] / var.sum()
    return mean, axes, explained


def pca_2d(fit: np.ndarray, *others: np.ndarray) -> tuple[np.ndarray, ...]:
    """Project onto the two principal axes of ``fit`` (:func:`pca_fit`).

    ``fit`` ``(T, D)`` is centred on its mean; the same mean and axes transform each of
    ``others`` ``(T', D)`` (the static-vs-contextual view fits on the static vectors and
    transforms the contextual ones). With fewer than two directions of variance the missing coordinates are 0.

    Returns:
        ``(fit_2d, *others_2d)``, each ``(T, 2)``.

    >>> a = np.array([[0., 0, 0], [2, 0, 0], [0, 1, 0]])
    >>> p, = pca_2d(a)
    >>> p.shape, bool(abs(p[:, 0]).max() >= abs(p[:, 1]).max())
    ((3, 2), True)
    """
    mean, axes, _ = pca_fit(fit)
    out = []
    for arr in (fit, *others):
        arr = np.asarray(arr, dtype=np.float64)
        if arr.ndim != 2 or arr.shape[1] != mean.shape[0]:
            raise shape_error("others", arr.shape, f"(T, {mean.shape[0]})")
        out.append((arr - mean) @ axes.T)
    return tuple(out)


def plot_embeddings(
    static: np.ndarray,
    contextual: np.ndarray,
    tokens: Sequence[str],
    *,
    title: str | None = None,
    path: str | os.PathLike | None = None,
):
    """The static-vs-contextual view: static (blue) and contextual (red) token vectors in
    2-D, with an arrow from each token's static point to its contextual point.

    PCA is fitted on the static vectors and applied to the contextual ones, so both share
    one pair of axes and an arrow shows how attention moved a token. Every point is
    labelled; labels that would overlap are spread apart (with a thin leader line when moved
    away from their point). When the contextual points huddle together (attention averages
    the value vectors), a second panel shows them magnified.

    Args:
        static: ``(T, D)`` token vectors before attention.
        contextual: ``(T, D)`` after attention.
        tokens: ``T`` labels.
        title: the figure's title.
        path: save there (``.png`` or ``.svg``).

    Returns:
        The ``Figure``: one axes with two scatter sets, ``T`` arrows and a label per point
        (equal points share one, "the ×2"); a second axes when the contextual points are
        magnified.

    >>> rng = np.random.default_rng(0)
    >>> s, c = rng.standard_normal((2, 3, 8))
    >>> fig = plot_embeddings(s, c, ["a", "b", "c"])
    >>> sum(p.get_gid() == "token-arrow" for p in fig.axes[0].patches)   # one per token
    3
    """
    Figure = _pyplot()
    s = np.asarray(static, dtype=np.float64)
    c = np.asarray(contextual, dtype=np.float64)
    if s.ndim != 2:
        raise shape_error("static", s.shape, "(T, D)")
    if c.shape != s.shape:
        raise shape_error("contextual", c.shape, f"{s.shape} like static")
    labels = _labels(tokens, s.shape[0], "tokens")
    s2, c2 = pca_2d(s, c)

    pts = np.concatenate([s2, c2])
    lo, hi = pts.min(axis=0), pts.max(axis=0)
    span = float((hi - lo).max()) or 1.0
    c_span = float(np.ptp(c2, axis=0).max())
    # Attention averages the value vectors, so the contextual points often huddle together;
    # then a second panel shows them magnified (same projection, same directions).
    zoom = len(labels) > 1 and c_span < 0.25 * span
    title = title or "Static vs contextual token vectors"
    if zoom:
        fig = Figure(figsize=(16, 7.5), layout="constrained")
        ax, zax = fig.subplots(1, 2, width_ratios=[1.25, 1])
        fig.suptitle(title, fontsize=13)
        ax.set_title("static and contextual points", fontsize=11)
    else:
        fig = Figure(figsize=(9, 7.5), layout="constrained")
        ax = fig.add_subplot()
        ax.set_title(title, fontsize=13)
    pad = 0.1 * span
    ax.set_xlim(lo[0] - pad, hi[0] + pad)
    ax.set_ylim(lo[1] - pad, hi[1] + pad)
    writers = [_draw_points(ax, s2, c2, labels, span, contextual_labels=not zoom)]
    ax.set_xlabel("PCA component 1 (fitted on the static vectors)")
    ax.set_ylabel("PCA component 2")
    ax.grid(True, alpha=0.3)
    if zoom:
        writers.append(_zoom_panel(ax, zax, s2, c2, labels, c_span))
    # The labels are placed in points, so the layout is settled first (with room for the
    # legend's note) and then kept: labels never overprint each other.
    legend = ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=2, frameon=False,
                       title=" ", title_fontsize=9)
    _use_fonts(fig, [*labels, title])
    with _no_glyph_warnings():
        fig.draw_without_rendering()
    fig.set_layout_engine("none")
    counts = [write() for write in writers]
    drawn, left_out = (sum(c[i] for c in counts) for i in (0, 1))
    if left_out:  # those with no room are left out, and the legend says so
        legend.get_title().set_text(f"{drawn} of {drawn + left_out} point labels drawn; {left_out} left out "
                                    "where there was no room")
        legend.get_title().set_gid("labels-left-out")
    _use_fonts(fig, [*labels, title])  # the labels just written
    if path is not None:
        save_figure(fig, path)
    return fig


def _group_labels(points: np.ndarray, labels: list[str], tol: float) -> list[tuple]:
    """Points that coincide (equal words without positions) share one label: "the ×2"."""
    groups: list[tuple[np.ndarray, list[str]]] = []
    for p, lab in zip(points, labels, strict=True):
        for q, labs in groups:
            if np.abs(p - q).max() <= tol:
                labs.append(lab)
                break
        else:
            groups.append((p, [lab]))
    out = []
    for p, labs in groups:
        names = list(dict.fromkeys(labs))
        text = ", ".join(f"{n} ×{labs.count(n)}" if labs.count(n) > 1 else n for n in names)
        out.append((p, text))
    return out


# Where a label may sit around its point, nearest first: the corners, then above, below,
# right and left; each tried at growing distances (in units of ``gap``).
_DIRECTIONS = ((1, 1), (1, -1), (-1, 1), (-1, -1), (0, 1), (0, -1), (1, 0), (-1, 0))
_RINGS = (1, 2, 3, 5, 8, 12, 18)


def spread_labels(
    anchors: np.ndarray,
    sizes: np.ndarray,
    *,
    obstacles: np.ndarray | None = None,
    bounds: tuple[float, float, float, float] | None = None,
    gap: float = 3.0,
    drop: bool = False,
) -> np.ndarray:
    """Place text boxes next to their points so that no two overlap (greedy, in order).

    Each box is tried at the corners of its point, then above, below, right and left, at
    growing distances; it takes the first place that overlaps no placed box, no obstacle
    and stays inside ``bounds``, else the place with the least overlap (with ``drop``:
    no place, its row is NaN, and the label is left out). Coordinates are
    any length unit with y up (points on a figure) or y down (pixels): the same rules hold.

    Args:
        anchors: ``(n, 2)`` the points being labelled.
        sizes: ``(n, 2)`` width and height of each label's box.
        obstacles: ``(m, 4)`` boxes ``(x0, y0, x1, y1)`` to keep clear (the markers).
        bounds: ``(x0, y0, x1, y1)`` the area labels must stay in.
        gap: the distance unit between a point and its label.

    Returns:
        ``(n, 3)``: each box's lower corner ``(x0, y0)`` (the smaller coordinates) and its
        ring, the distance in ``gap`` units (1 = right beside its point).

    >>> boxes = spread_labels(np.array([[0.0, 0.0], [1.0, 0.0]]), np.array([[10.0, 4.0]] * 2))
    >>> boxes[:, :2].tolist()        # the second label moves below instead of overprinting
    [[3.0, 3.0], [4.0, -7.0]]
    """
    anchors = np.asarray(anchors, dtype=np.float64).reshape(-1, 2)
    sizes = np.asarray(sizes, dtype=np.float64).reshape(-1, 2)
    placed = np.asarray(obstacles if obstacles is not None else np.empty((0, 4)), np.float64)
    placed = list(placed.reshape(-1, 4))
    out = np.zeros((len(anchors), 3))
    for k, ((x, y), (w, h)) in enumerate(zip(anchors, sizes, strict=True)):
        boxes = np.array(placed).reshape(-1, 4)
        best, best_cost = None, np.inf
        for ring in _RINGS:
            d = gap * ring
            for ux, uy in _DIRECTIONS:
                x0 = x + d if ux > 0 else x - d - w if ux < 0 else x - w / 2
                y0 = y + d if uy > 0 else y - d - h if uy < 0 else y - h / 2
                cost = _overlap(boxes, x0, y0, x0 + w, y0 + h)
                if bounds is not None:
                    bx0, by0, bx1, by1 = bounds
                    inside = max(0.0, min(x0 + w, bx1) - max(x0, bx0)) * max(0.0, min(y0 + h, by1) - max(y0, by0))
                    cost += w * h - inside
                cost = 0.0 if cost < 1e-9 * w * h else cost  # rounding, not an overlap
                if cost < best_cost:
                    best, best_cost = (x0, y0, ring), cost
                if cost == 0:
                    break
            if best_cost == 0:
                break
        if drop and best_cost > 0:
            out[k] = np.nan
            continue
        out[k] = best
        placed.append((best[0], best[1], best[0] + w, best[1] + h))
    return out


def _overlap(boxes: np.ndarray, x0: float, y0: float, x1: float, y1: float) -> float:
    if not len(boxes):
        return 0.0
    dx = np.minimum(boxes[:, 2], x1) - np.maximum(boxes[:, 0], x0)
    dy = np.minimum(boxes[:, 3], y1) - np.maximum(boxes[:, 1], y0)
    return float((np.clip(dx, 0, None) * np.clip(dy, 0, None)).sum())


def text_width(text: str, fontsize: float) -> float:
    """The width in points of ``text`` at ``fontsize`` in matplotlib's default font, measured
    without a renderer; characters that font lacks count as wide ones (1 em: CJK).

    >>> round(text_width("iii", 10)) < round(text_width("WWW", 10))
    True
    """
    from matplotlib import font_manager, rcParams

    font = font_manager.get_font(font_manager.findfont(font_manager.FontProperties(family=rcParams["font.family"])))
    have = _charmap(font.fname)
    own = "".join(c for c in text if ord(c) in have)
    other = len(text) - len(own)
    font.set_size(fontsize, 72)
    font.set_text(own)
    return font.get_width_height()[0] / 64 + other * fontsize


def _axes_points(ax):
    """A function mapping data coordinates of ``ax`` to points on the figure, and the axes'
    box in points, from the axes' current position (:func:`plot_embeddings` settles the
    layout before it places labels)."""
    fig = ax.get_figure()
    w_in, h_in = fig.get_size_inches()
    box = ax.get_position()
    x0, y0, x1, y1 = box.x0 * w_in * 72, box.y0 * h_in * 72, box.x1 * w_in * 72, box.y1 * h_in * 72
    (dx0, dx1), (dy0, dy1) = ax.get_xlim(), ax.get_ylim()

    def to_points(p: np.ndarray) -> np.ndarray:
        p = np.asarray(p, dtype=np.float64).reshape(-1, 2)
        return np.stack([x0 + (p[:, 0] - dx0) / (dx1 - dx0) * (x1 - x0),
                         y0 + (p[:, 1] - dy0) / (dy1 - dy0) * (y1 - y0)], axis=1)

    return to_points, (x0, y0, x1, y1)


def _label_points(ax, items: list[tuple[np.ndarray, str, str]], markers: np.ndarray, *,
                  fontsize: float, marker_pt: float = 9.0) -> tuple[int, int]:
    """Write ``(point, text, colour)`` labels on ``ax``, spread so that none overlaps another
    label or a marker; a label moved away from its point gets a thin leader line. A label
    with no free place is left out; returns ``(labels drawn, labels left out)``."""
    if not items:
        return 0, 0
    to_points, bounds = _axes_points(ax)
    anchors = to_points(np.array([p for p, _, _ in items]))
    sizes = np.array([(text_width(t, fontsize) + 3, 1.3 * fontsize) for _, t, _ in items])
    m = to_points(markers)
    r = marker_pt / 2
    obstacles = np.concatenate([m - r, m + r], axis=1)
    boxes = spread_labels(anchors, sizes, obstacles=obstacles, bounds=bounds, gap=marker_pt / 3, drop=True)
    for (p, text, color), a, (bx, by, ring) in zip(items, anchors, boxes, strict=True):
        if np.isnan(bx):
            continue
        far = ring > 2
        ax.annotate(
            text, tuple(p), xytext=(bx - a[0], by - a[1]), textcoords="offset points",
            ha="left", va="bottom", color=color, fontsize=fontsize, zorder=4, gid="token-label",
            arrowprops=dict(arrowstyle="-", color=color, lw=0.6, alpha=0.7, shrinkA=0, shrinkB=3)
            if far else None,
        )
    dropped = int(np.isnan(boxes[:, 0]).sum())
    return len(items) - dropped, dropped


# Above this many tokens the arrows are drawn as one quiver, not one patch each.
_MAX_ARROW_PATCHES = 64


def _draw_points(ax, s2, c2, labels, span, *, arrows: bool = True, fontsize: float = 11,
                 only_contextual: bool = False, contextual_labels: bool = True):
    from matplotlib.patches import FancyArrowPatch

    if arrows and len(labels) > _MAX_ARROW_PATCHES:  # one artist for all: a second, not many
        ax.quiver(s2[:, 0], s2[:, 1], c2[:, 0] - s2[:, 0], c2[:, 1] - s2[:, 1], angles="xy",
                  scale_units="xy", scale=1, color="0.45", alpha=0.6, width=0.0015, headwidth=4,
                  headlength=5, zorder=2, gid="token-arrows")
    elif arrows:
        for i in range(len(labels)):
            ax.add_patch(FancyArrowPatch(
                tuple(s2[i]), tuple(c2[i]), arrowstyle="-|>", mutation_scale=14, color="0.45",
                lw=1.1, alpha=0.75, shrinkA=5, shrinkB=5, zorder=2, gid="token-arrow",
            ))
    tol = 1e-6 * max(span, 1e-12)
    items = []
    if not only_contextual:
        ax.scatter(s2[:, 0], s2[:, 1], s=70, color=STATIC_COLOR, zorder=3, edgecolor="white",
                   label="static (before attention)")
        items += [(p, text, STATIC_COLOR) for p, text in _group_labels(s2, labels, tol)]
    ax.scatter(c2[:, 0], c2[:, 1], s=60, color=CONTEXT_COLOR, marker="D", zorder=3,
               edgecolor="white", label="contextual (after attention)")
    if contextual_labels:
        items += [(p, text, CONTEXT_COLOR) for p, text in _group_labels(c2, labels, tol)]
    markers = c2 if only_contextual else np.concatenate([s2, c2])
    return lambda: _label_points(ax, items, markers, fontsize=fontsize)  # once the layout is final


def _zoom_panel(ax, zax, s2, c2, labels, c_span):
    """Mark the contextual cluster on ``ax`` with a box and draw it magnified on ``zax``."""
    from matplotlib.patches import Rectangle

    c_span = c_span or 1.0
    lo, hi = c2.min(axis=0), c2.max(axis=0)
    mid, half = (lo + hi) / 2, 0.6 * c_span
    ax.add_patch(Rectangle(tuple(mid - half), 2 * half, 2 * half, fill=False, ec="0.35",
                           ls="--", lw=1.0, zorder=5, gid="zoom-box"))
    zax.set_xlim(mid[0] - half, mid[0] + half)
    zax.set_ylim(mid[1] - half, mid[1] + half)
    write_labels = _draw_points(zax, s2, c2, labels, c_span, arrows=False, fontsize=10, only_contextual=True)
    zax.set_title("contextual points, magnified (dashed box on the left)", fontsize=11)
    zax.set_xlabel("PCA component 1 (same projection)")
    zax.grid(True, alpha=0.3)
    for side in zax.spines.values():
        side.set_linestyle("--")
        side.set_edgecolor("0.35")
    return write_labels


def plot_training_curves(
    history: Mapping[str, Sequence[float]],
    evals: Sequence[Mapping[str, float]] = (),
    *,
    title: str | None = None,
    path: str | os.PathLike | None = None,
):
    """Loss and accuracy of a training run, per step, with the held-out checks on top.

    Args:
        history: ``{"step": [...], "loss": [...], "accuracy": [...]}`` per training batch
            (:attr:`attnlab.train.Trainer.history`).
        evals: held-out checks ``{"step", "loss", "accuracy"}``, drawn as points.
        title: the figure's title.
        path: save there (``.png`` or ``.svg``).

    Returns:
        The ``Figure``: a loss axes (log scale) and an accuracy axes.

    >>> fig = plot_training_curves({"step": [1, 2, 3], "loss": [2.0, 1.0, 0.5],
    ...                             "accuracy": [0.1, 0.4, 0.9]},
    ...                            [{"step": 3, "loss": 0.6, "accuracy": 0.8}])
    >>> [ax.get_title() for ax in fig.axes]
    ['loss', 'accuracy']
    """
    Figure = _pyplot()
    for key in ("step", "loss", "accuracy"):
        if key not in history:
            raise ValueError(f"history needs a {key!r} list, got keys {sorted(history)}")
    steps = np.asarray(history["step"], dtype=np.float64)
    for key in ("loss", "accuracy"):
        if len(history[key]) != len(steps):
            raise ValueError(f"history[{key!r}] has {len(history[key])} values for {len(steps)} steps")
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot(steps, history["loss"], lw=0.6, alpha=0.5, label="train (batch)")
    ax2.plot(steps, history["accuracy"], lw=0.6, alpha=0.5, label="train (batch)")
    if evals:
        es = [e["step"] for e in evals]
        ax1.plot(es, [e["loss"] for e in evals], "o-", ms=3, label="held-out")
        ax2.plot(es, [e["accuracy"] for e in evals], "o-", ms=3, label="held-out")
    positive = np.asarray(history["loss"], dtype=np.float64)
    if positive.size and np.all(positive[np.isfinite(positive)] > 0):
        ax1.set_yscale("log")
    ax1.set(xlabel="step", ylabel="cross-entropy (answers only)", title="loss")
    ax2.set(xlabel="step", ylabel="answer accuracy", ylim=(0, 1.02), title="accuracy")
    for ax, where in ((ax1, "upper right"), (ax2, "lower right")):
        ax.grid(alpha=0.3)
        ax.legend(loc=where)
    fig.suptitle(title or "Training curves")
    if path is not None:
        save_figure(fig, path, dpi=110)
    return fig


def plot_finetune_loss(history: Mapping[str, Sequence[float]], *, title: str | None = None,
                       path: str | os.PathLike | None = None):
    """The loss of a fine-tuning run per step (:attr:`attnlab.train.finetune.Finetuner.history`:
    ``"step"``, ``"loss"``, and ``"eval_step"``/``"eval_loss"`` drawn as points), log scale.

    >>> fig = plot_finetune_loss({"step": [1, 2, 3], "loss": [2.0, 1.0, 0.5], "eval_step": [3], "eval_loss": [0.7]})
    >>> fig.axes[0].get_ylabel()
    'cross-entropy (answer tokens)'
    """
    Figure = _pyplot()
    for key in ("step", "loss"):
        if key not in history:
            raise ValueError(f"history needs a {key!r} list, got keys {sorted(history)}")
    if len(history["loss"]) != len(history["step"]):
        raise ValueError(f"history['loss'] has {len(history['loss'])} values for {len(history['step'])} steps")
    fig = Figure(figsize=(6.4, 3.8), layout="constrained")
    ax = fig.subplots()
    ax.plot(history["step"], history["loss"], lw=0.9, label="train (each step's batch)")
    if history.get("eval_step"):
        ax.plot(history["eval_step"], history["eval_loss"], "o-", ms=3, label="evaluation")
    loss = np.asarray(history["loss"], dtype=np.float64)
    if loss.size and np.all(loss[np.isfinite(loss)] > 0):
        ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="cross-entropy (answer tokens)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.suptitle(title or "Fine-tuning loss")
    if path is not None:
        save_figure(fig, path, dpi=110)
    return fig
