"""The report's views one at a time, inline in a Jupyter notebook.

``attnlab.viz.show(explanation, view="head")`` gives one interactive view (the head view,
the model view, the logit lens, the patching heatmap, or any other tab of the report) as
an object that Jupyter displays (the cell's last value, or ``IPython.display.display``).
Each view carries only the numbers it draws; the report's script and style (about 80 KB)
come with the first view shown in a notebook and the later ones only call it, as plotly
does. Several views share a page without clashing (no ids; each starts once). Nothing is
fetched: the numbers are in the page, the script is attnlab's own.

A notebook saved with its outputs keeps the script in the first view's output: a later
view whose first was cleared shows a line that says so (``show(..., script=True)`` brings
the script again).
"""

from __future__ import annotations

import html

from attnlab.viz.html_report import VIEWS, _asset, _json_for_script, _payload, visible_text

__all__ = ["VIEWS", "View", "show"]

_TITLES = {"head": "Head view", "model": "Model view", "heatmap": "Heatmap", "steps": "Steps",
           "embedding": "Embeddings", "lens": "Logit lens", "detectors": "Head detectors",
           "patching": "Activation patching", "rollout": "Attention rollout"}
_WHY_NOT = {"steps": "it has no step-by-step trace (explain(..., trace=True) records one)",
            "lens": "only decoders have a logit lens (explain(..., model='smollm2') or 'gpt2')",
            "detectors": "only decoders have head detector scores",
            "patching": "it has no activation patching (explain(..., corrupt=TEXT) records one)",
            "rollout": "attention rollout is drawn for encoders (explain(..., model='minilm'))"}
_HAS = {"steps": "trace", "lens": "lens", "detectors": "head_scores", "patching": "patching", "rollout": "rollout"}

#: Whether this process has shown a view with the script (once per notebook page).
_sent = {"script": False}


class View:
    """One view of an explanation, displayed by Jupyter (``_repr_html_``).

    Attributes:
        view: which view (one of :data:`VIEWS`).
        html: the view's HTML without the script (:meth:`to_html` adds it).
    """

    def __init__(self, view: str, body: str, *, script: bool | None = None):
        self.view, self.html, self.script = view, body, script

    def to_html(self, *, script: bool = True) -> str:
        """The view's HTML: with ``script`` the report's style and script too (a page that
        holds no other attnlab view needs them), else a call of the script already on the
        page."""
        if script:
            return f"<style>{_asset('report.css')}</style>{self.html}<script>{_asset('report.js')}</script>"
        return f"{self.html}<script>window.attnlabReport && window.attnlabReport.start();</script>"

    def _repr_html_(self) -> str:
        script = (not _sent["script"]) if self.script is None else self.script
        _sent["script"] = _sent["script"] or script
        return self.to_html(script=script)

    def __repr__(self) -> str:
        return f"<attnlab view {self.view!r}: {len(self.html):,} characters of HTML; display it in Jupyter>"


def show(explanation, view: str = "head", *, layer: int | None = None, head: int | None = None,
         script: bool | None = None) -> View:
    """One interactive view of ``explanation`` for a notebook: the head view (lines from
    each token to the tokens it attends to), ``"model"`` (every layer and head), ``"lens"``
    (the logit lens), ``"patching"`` (activation patching), or any tab of the report
    (:data:`VIEWS`).

    Args:
        explanation: an :class:`~attnlab.explain.Explanation`.
        view: which view.
        layer, head: the layer (``1..n``) and head to open on (default: the explanation's).
        script: include the report's script and style (None: with the first view this
            process shows, once per notebook; True: always, e.g. for a page of its own).

    Returns:
        A :class:`View`; Jupyter displays it inline.

    Raises:
        ValueError: an unknown view, or one the explanation has no data for (a decoder's
            lens for an encoder, patching without a corrupted text), or a bad layer/head.

    >>> from attnlab.explain import explain
    >>> v = show(explain("The cat sat", dim=8, heads=2), "model")
    >>> v.view, 'data-view-only="model"' in v.html, len(v.to_html(script=False)) < 10_000
    ('model', True, True)
    """
    if view not in VIEWS:
        raise ValueError(f"view must be one of {', '.join(VIEWS)}; got {view!r}")
    attr = _HAS.get(view)
    if attr is not None and getattr(explanation, attr, None) is None:
        raise ValueError(f"this explanation has no {_TITLES[view].lower()} view: {_WHY_NOT[view]}")
    if layer is not None or head is not None:
        import copy

        from attnlab._validation import layer_number
        from attnlab.explain import _head_index

        explanation = copy.copy(explanation)
        if layer is not None:
            explanation.layer = layer_number(layer, explanation.n_layers, embeddings=False)
        if head is not None:
            explanation.head = _head_index(head, explanation.n_heads)
    data = _payload(explanation, views={view})
    text = data["text"] if len(data["text"]) <= 80 else data["text"][:79] + "\u2026"
    caption = (f'<p class="al-meta">{html.escape(_TITLES[view])} \u00b7 {html.escape(visible_text(data["model"]))} '
               f"\u00b7 <q>{html.escape(visible_text(text))}</q></p>")
    body = (f'<div class="attnlab-report attnlab-view" data-format="1" data-view-only="{view}">{caption}'
            '<div class="al-app"><p class="al-fallback">This view needs attnlab\'s script, which the first attnlab '
            "view of a notebook brings (and JavaScript: in Jupyter, trust the notebook); its output may have "
            "been cleared: show it again, or call attnlab.viz.show(..., script=True).</p></div>"
            f'<script type="application/json" class="al-data">{_json_for_script(data)}</script></div>')
    return View(view, body, script=script)
