"""The pictures of an :class:`~attnlab.explain.Explanation`, as matplotlib figures."""

from __future__ import annotations


def explanation_figures(expl) -> dict:
    """``{file name: Figure}``: ``heatmap.png`` (the explanation's layer and head),
    ``heads.png`` (every head of that layer) and ``embeddings.png`` (the
    static-vs-contextual view, PCA). Layers are numbered as everywhere (1..n).

    Raises:
        ImportError: matplotlib (the ``viz`` extra) is missing.

    >>> from attnlab.explain import explain
    >>> sorted(explanation_figures(explain("a cat sat", dim=8, heads=2)))
    ['embeddings.png', 'heads.png', 'heatmap.png']
    """
    from attnlab.viz import plots

    tokens = expl.readable_tokens() if hasattr(expl, "readable_tokens") else list(expl.tokens)
    plots._pyplot()  # ImportError without matplotlib, before anything is drawn
    layer, head, n_layers = expl.layer, expl.head, expl.n_layers
    short = expl.model.split(":")[0]
    text = expl.text if len(expl.text) <= 60 else expl.text[:57] + "..."
    return {
        "heatmap.png": plots.plot_attention(
            expl.weights(), tokens,
            title=f"Attention weights, layer {layer} (of 1-{n_layers}), head {head} (of 0-{expl.n_heads - 1})"
                  f" \u00b7 {short}"
                  f"\n\u201c{text}\u201d"),
        "heads.png": plots.plot_heads(
            expl.attentions[layer - 1], tokens,
            title=f"All {expl.n_heads} heads (0-{expl.n_heads - 1}) of layer {layer} (of 1-{n_layers}) \u00b7 {short}"
                  f"\n\u201c{text}\u201d"),
        "embeddings.png": plots.plot_embeddings(
            expl.static, expl.contextual, tokens,
            title=f"Static (layer 0) \u2192 contextual (layer {n_layers}) token vectors \u00b7 {short}"
                  f"\n\u201c{text}\u201d"),
    }
