"""What ``explain --attribute`` adds for a decoder: which prompt tokens made the predicted
next token (integrated gradients), and, given a corrupted text, attribution patching beside
activation patching and the circuit of heads that edge attribution (EAP-IG) finds, with its
faithfulness. Computed by :mod:`attnlab.inspect` (:func:`~attnlab.inspect.input_attribution`,
:func:`~attnlab.inspect.attribution_patching`, :func:`~attnlab.inspect.edge_attribution`,
:func:`~attnlab.inspect.circuit`, :func:`~attnlab.inspect.faithfulness`), so the numbers are
those functions' numbers.

Blocks count from 0, as the hook names do (``a3.h1`` is head 1 of block 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["CIRCUIT_EDGES", "IG_STEPS", "Attribution", "CircuitView", "decoder_attribution"]

#: Integrated gradients' points for the next token (Gauss-Legendre).
IG_STEPS = 32
#: Edges kept in the circuit (before pruning) and EAP-IG's points.
CIRCUIT_EDGES = 40
EAP_STEPS = 5


@dataclass
class CircuitView:
    """The circuit that EAP-IG finds, as the report draws it.

    Attributes:
        edges: ``[(source, target, score)]``, largest ``|score|`` first (node names of
            :mod:`attnlab.inspect.edges`: ``input``, ``a{block}.h{head}``, ``m{block}``,
            targets with ``<q>``, ``<k>``, ``<v>``, ``logits``).
        faithfulness: the share of the metric the circuit recovers when run with every
            other edge patched to its corrupted value.
        circuit_value: the metric of that run.
        edges_scored: how many edges the model's graph has.
        steps: EAP-IG's points.
    """

    edges: list[tuple[str, str, float]]
    faithfulness: float
    circuit_value: float
    edges_scored: int
    steps: int = EAP_STEPS


@dataclass
class Attribution:
    """Input attribution of a decoder's predicted next token and, with a corrupted text,
    attribution patching and a circuit.

    Attributes:
        scores: ``(T,)`` integrated gradients of the log-probability of :attr:`target_token`
            at the last position, per prompt token (the sum over its embedding's dims).
        target_id, target_token: the attributed token (the clean run's prediction).
        method, steps, baseline: how (``"integrated_gradients"``, Gauss-Legendre points,
            ``"zeros"`` or ``"pad"``).
        value, baseline_value, gap: the log-probability at the text and at the baseline, and
            the completeness gap ``scores.sum() - (value - baseline_value)``.
        atp: ``(N, T)`` attribution patching of ``resid_pre`` with the gradient at the
            corrupted run (the estimate of ``patching.values - patching.corrupted_value``:
            add ``corrupted_value`` to compare with activation patching), or None.
        atp_clean: the same with the gradient at the clean run (Nanda's form: it estimates
            what the clean run loses when the cell is corrupted), or None.
        circuit: the :class:`CircuitView`, or None.
    """

    scores: np.ndarray
    target_id: int
    target_token: str
    method: str
    steps: int
    baseline: str
    value: float
    baseline_value: float
    gap: float
    atp: np.ndarray | None = None
    atp_clean: np.ndarray | None = None
    circuit: CircuitView | None = None

    @property
    def relative_gap(self) -> float:
        """``|gap| / |value - baseline_value|``."""
        change = abs(self.value - self.baseline_value)
        return abs(self.gap) / change if change else float("nan")


def decoder_attribution(model, ids: np.ndarray, target_id: int, target_token: str, *, patching=None,
                        corrupted_ids: np.ndarray | None = None) -> Attribution:
    """The :class:`Attribution` of one text's next token ``target_id``; with ``patching`` (a
    :class:`~attnlab.explain.inside.Patching`) and the corrupted text's ids, also attribution
    patching with the patching's metric and the EAP-IG circuit.

    >>> from attnlab.models import GPT2, GPT2Config
    >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2),
    ...              rng=np.random.default_rng(0))
    >>> a = decoder_attribution(model, np.array([1, 2, 3]), 7, "t7")
    >>> a.scores.shape, a.baseline, a.atp is None
    ((3,), 'zeros', True)
    """
    from attnlab.inspect import (
        attribution_patching,
        circuit,
        edge_attribution,
        faithfulness,
        input_attribution,
        logit_diff,
    )

    ids = np.asarray(ids)
    baseline = "zeros" if any(n.endswith("hook_pos_embed") for n in model.hook_names()) else "pad"
    r = input_attribution(model, ids, int(target_id), steps=IG_STEPS, baseline=baseline)
    out = Attribution(scores=np.asarray(r.scores, np.float64), target_id=int(target_id), target_token=target_token,
                      method=r.method, steps=r.steps, baseline=baseline, value=float(r.value),
                      baseline_value=float(r.baseline_value), gap=float(r.gap))
    if patching is None or corrupted_ids is None:
        return out
    metric = logit_diff(int(patching.clean_id), int(patching.corrupted_id))
    clean, corrupted = ids[None], np.asarray(corrupted_ids)[None]
    out.atp = attribution_patching(model, clean, corrupted, metric, gradient_at="corrupted")
    out.atp_clean = attribution_patching(model, clean, corrupted, metric)
    try:
        graph = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=EAP_STEPS)
    except TypeError:  # a model whose blocks are not pre-norm residual sums: no circuit
        return out
    found = circuit(graph, top_n=CIRCUIT_EDGES)
    faith = faithfulness(model, found, clean, corrupted, metric)
    out.circuit = CircuitView(edges=[(s, t, float(v)) for (s, t), v in found.top(len(found))],
                              faithfulness=float(faith.share), circuit_value=float(faith.circuit),
                              edges_scored=int(np.isfinite(graph.scores).sum()))
    return out
