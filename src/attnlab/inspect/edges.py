"""Edge attribution: a score for every edge between a decoder's components (the embeddings,
each head, each MLP, the logits), a circuit of the best edges, and its faithfulness measured
by running it.

The graph (Hanna et al.'s, arXiv 2403.17806, over attnlab's hook points). Sources, in
forward order: ``input`` (``hook_embed``, the token embeddings), ``a{l}.h{h}`` (head ``h``
of block ``l``: its output ``z_h W_O^h``, what it adds to the residual stream) and ``m{l}``
(``hook_mlp_out``). Targets: each head's query input ``a{l}.h{h}<q>``, key and value inputs
``a{l}.h{h}<k>``, ``<v>`` (``a{l}.kv{g}<k>`` per key/value head ``g`` under grouped-query
attention), each MLP's input ``m{l}`` and ``logits`` (the last block's residual output).
An edge joins every source to every target that reads the residual after it: into block
``l``'s heads from the sources before block ``l``, into its MLP from those and block ``l``'s
heads. A target's input is the sum of its sources' outputs (plus constants: biases,
position embeddings), so patching one edge means giving one target one source's corrupted
output: the blocks' per-head input points (``hook_q_input``, ``hook_k_input``,
``hook_v_input``, ``hook_mlp_in``) make that a real intervention.

Scores are signed as :func:`~attnlab.inspect.attribution_patching`'s: ``(a_u(clean) -
a_u(corrupted)) . d metric / d x_v``, summed over the batch, the positions and the width, a
positive edge carrying the clean behaviour (the EAP-IG authors' code stores the negative,
``corrupted - clean``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from attnlab.inspect._grad import check_differentiable, run_with_grads
from attnlab.inspect._model import MLP_OUT, Z, blocks, output_projection
from attnlab.inspect.interventions import _choice, _number, same_shape_ids
from attnlab.inspect.metrics import check_metric

__all__ = ["EDGE_METHODS", "EdgeGraph", "Faithfulness", "circuit", "edge_attribution", "faithfulness"]

EDGE_METHODS = ("eap", "eap-ig")
"""``edge_attribution``'s methods."""
IG_POINTS = ("riemann_right", "riemann_left")
"""Where EAP-IG takes its gradients, ``alpha = k / steps`` of the way from the corrupted
input embeddings to the clean ones: ``k = 1..steps`` (the paper; ``steps=1`` is EAP) or
``k = 0..steps-1`` (the authors' code)."""

EMBED = "hook_embed"
_INPUT_HOOK = {"q": "blocks.{l}.hook_q_input", "k": "blocks.{l}.hook_k_input", "v": "blocks.{l}.hook_v_input"}


class _Layout:
    """A model's graph: source and target names, where each source writes and each target
    reads (a step count in forward order), and the hook point each target reads from."""

    def __init__(self, model) -> None:
        layers = blocks(model)
        for i, b in enumerate(layers):
            if not getattr(b, "norm_first", False) or getattr(b, "ln_1_post", None) is not None \
                    or getattr(b, "ln_2_post", None) is not None:
                raise TypeError(f"edge attribution needs blocks whose attention and MLP outputs are added to the "
                                f"residual stream as they are (pre-norm, no norm after a sublayer); "
                                f"{type(model).__name__}'s block {i} is "
                                + ("post-norm" if not getattr(b, "norm_first", False) else "sandwich-normed"))
        if EMBED not in model.hook_names():
            raise TypeError(f"{type(model).__name__} has no hook_embed (the token embeddings): edge attribution "
                            "needs a decoder with attnlab's hook points")
        self.N = N = len(layers)
        self.H = H = int(layers[0].attn.num_heads)
        self.Hkv = Hkv = int(layers[0].attn.num_kv_heads)
        kv = "h" if Hkv == H else "kv"
        self.sources, src_at = ["input"], [0]
        self.targets, tgt_at, self.reads = [], [], []  # reads: (hook name, index in its head axis or None)
        for l in range(N):
            self.sources += [f"a{l}.h{h}" for h in range(H)] + [f"m{l}"]
            src_at += [1 + 2 * l] * H + [2 + 2 * l]
            for part, count, letter in (("q", H, "h"), ("k", Hkv, kv), ("v", Hkv, kv)):
                for h in range(count):
                    self.targets.append(f"a{l}.{letter}{h}<{part}>")
                    self.reads.append((_INPUT_HOOK[part].format(l=l), h))
                    tgt_at.append(1 + 2 * l)
            self.targets.append(f"m{l}")
            self.reads.append((f"blocks.{l}.hook_mlp_in", None))
            tgt_at.append(2 + 2 * l)
        self.targets.append("logits")
        self.reads.append((f"blocks.{N - 1}.hook_resid_post", None))
        tgt_at.append(2 * N + 1)
        self.src_at, self.tgt_at = np.array(src_at), np.array(tgt_at)
        self.real = self.src_at[:, None] < self.tgt_at[None, :]  # (U, V): the edges
        self.source_hooks = [EMBED] + [n for l in range(N) for n in (Z.format(i=l), MLP_OUT.format(i=l))]
        self.W_O = [np.asarray(output_projection(b.attn)[0], np.float64) for b in layers]  # (H, D, E)
        self.read_hooks = list(dict.fromkeys(name for name, _ in self.reads))

    def outputs(self, acts: Mapping) -> np.ndarray:
        """Every source's output ``(U, B, T, E)``, float64, from one run's activations."""
        out = [_batched(acts[EMBED])]
        for l in range(self.N):
            z = np.asarray(acts[Z.format(i=l)], np.float64)  # (B, T, H, D)
            out += list(np.einsum("bthd,hde->hbte", z, self.W_O[l]))
            out.append(_batched(acts[MLP_OUT.format(i=l)]))
        return np.stack(out)

    def gradients(self, grads: Mapping) -> np.ndarray:
        """Every target's input gradient ``(V, B, T, E)``, float64."""
        return np.stack([_batched(grads[name]) if h is None else np.asarray(grads[name], np.float64)[:, :, h]
                         for name, h in self.reads])


def _batched(a) -> np.ndarray:
    """A float64 copy of ``a``, batch first (a live activation may be updated in place later:
    the MLP's output becomes the residual)."""
    a = np.array(a, np.float64)
    return a if a.ndim == 3 else a[None]


class EdgeGraph(Mapping):
    """Edges with a score each, readable as a mapping ``(source, target) -> score`` (see
    :mod:`attnlab.inspect.edges` for the node names).

    Attributes:
        sources, targets: the node names, in forward order.
        scores: float64 ``(len(sources), len(targets))``, NaN where there is no edge.
        included: bool, the same shape: the edges this graph holds (every edge of the
            model for :func:`edge_attribution`'s result; a circuit's for :func:`circuit`'s).
        method, steps, points: how the scores were computed.
        clean_value, corrupted_value: the metric on the clean and the corrupted run.
    """

    def __init__(self, sources: list[str], targets: list[str], scores: np.ndarray, included: np.ndarray, *,
                 method: str, steps: int, points: str | None, clean_value: float, corrupted_value: float) -> None:
        self.sources, self.targets = list(sources), list(targets)
        self.scores, self.included = scores, included
        self.method, self.steps, self.points = method, steps, points
        self.clean_value, self.corrupted_value = clean_value, corrupted_value
        self._src = {n: i for i, n in enumerate(self.sources)}
        self._tgt = {n: i for i, n in enumerate(self.targets)}

    def index(self, edge: object) -> tuple[int, int]:
        """``(row, column)`` of an edge of the model's graph, or a KeyError naming it."""
        if not (isinstance(edge, tuple) and len(edge) == 2):
            raise KeyError(f"an edge is a (source, target) pair of node names, got {edge!r}")
        s, t = edge
        if s not in self._src or t not in self._tgt:
            bad = s if s not in self._src else t
            raise KeyError(f"{bad!r} is not a {'source' if s not in self._src else 'target'} node of this graph "
                           f"(sources look like 'input', 'a0.h1', 'm0'; targets like 'a1.h0<q>', 'm1', 'logits')")
        i, j = self._src[s], self._tgt[t]
        if np.isnan(self.scores[i, j]):
            raise KeyError(f"there is no edge {s} -> {t}: {t} reads the residual before {s} writes it")
        return i, j

    def __getitem__(self, edge) -> float:
        i, j = self.index(edge)
        if not self.included[i, j]:
            raise KeyError(f"the edge {edge[0]} -> {edge[1]} is not in this graph")
        return float(self.scores[i, j])

    def __iter__(self) -> Iterator[tuple[str, str]]:
        for i, j in zip(*np.nonzero(self.included), strict=True):
            yield self.sources[i], self.targets[j]

    def __len__(self) -> int:
        return int(self.included.sum())

    @property
    def nodes(self) -> list[str]:
        """The components: the sources, then ``logits``."""
        return [*self.sources, "logits"]

    def top(self, n: int) -> list[tuple[tuple[str, str], float]]:
        """The ``n`` edges with the largest ``|score|``, largest first, with their scores."""
        edges = list(self.items())
        edges.sort(key=lambda kv: -abs(kv[1]))
        return edges[:n]

    def with_edges(self, included: np.ndarray) -> EdgeGraph:
        return EdgeGraph(self.sources, self.targets, self.scores, included, method=self.method, steps=self.steps,
                         points=self.points, clean_value=self.clean_value, corrupted_value=self.corrupted_value)

    def __repr__(self) -> str:
        return (f"EdgeGraph({len(self)} of {int(np.isfinite(self.scores).sum())} edges, method={self.method!r}, "
                f"{len(self.sources) - 1} components)")


def edge_attribution(
    model,
    clean: np.ndarray,
    corrupted: np.ndarray,
    metric: Callable,
    *,
    method: str = "eap-ig",
    steps: int = 5,
    points: str = "riemann_right",
    **forward_kwargs,
) -> EdgeGraph:
    """Score every edge of the model's graph (see :mod:`attnlab.inspect.edges`).

    The score of the edge ``u -> v`` is ``(a_u(clean) - a_u(corrupted)) . g_v``, summed over
    the batch, the positions and the width, where ``a_u`` is source ``u``'s output and
    ``g_v`` the gradient of ``metric`` with respect to target ``v``'s input:

    - ``"eap"`` (edge attribution patching): ``g_v`` at the clean run: two forward passes,
      one backward pass;
    - ``"eap-ig"`` (with integrated gradients, Hanna et al. 2024): ``g_v`` averaged over
      ``steps`` runs whose token embeddings (``hook_embed``) are ``e_corrupted + alpha
      (e_clean - e_corrupted)``, ``alpha = k / steps`` for ``k = 1..steps`` (the paper's
      points, ``points="riemann_right"``; ``steps=1`` is EAP) or ``k = 0..steps-1`` (the
      authors' code, ``"riemann_left"``): two forward passes and ``steps`` forward and
      backward passes.

    Args:
        model: a pre-norm decoder (GPT-2, Llama, Mistral, Qwen; not Gemma's sandwich
            norms, not BERT) with float weights.
        clean, corrupted: token ids of the same shape, ``(B, T)`` or ``(T,)``.
        metric: a metric with ``.grad`` (:func:`~attnlab.inspect.logit_diff`, ...).
        method: ``"eap"`` or ``"eap-ig"``.
        steps: EAP-IG's number of points (>= 1).
        points: ``"riemann_right"`` or ``"riemann_left"``.
        **forward_kwargs: passed to every forward pass (e.g. ``attention_mask``).

    Returns:
        An :class:`EdgeGraph` holding every edge. Memory: the sources' outputs and the
        targets' gradients, ``(U + V) B T E`` float64 (SmolLM2, 14 tokens: 301 sources, 481
        targets, 50 MB).

    Raises:
        ValueError: clean and corrupted of different shapes; ``steps < 1``; an unknown
            method or points.
        TypeError: a metric without ``.grad``; quantized weights (load dequantized); a
            post-norm or sandwich-normed model.

    >>> from attnlab.models import GPT2, GPT2Config
    >>> from attnlab.inspect import logit_diff
    >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2),
    ...              rng=np.random.default_rng(0))
    >>> graph = edge_attribution(model, np.array([[1, 2, 3, 4]]), np.array([[1, 5, 3, 4]]), logit_diff(7, 8))
    >>> graph
    EdgeGraph(46 of 46 edges, method='eap-ig', 6 components)
    >>> bool(graph["a0.h1", "a1.h0<k>"] == graph.scores[2, 9])
    True
    """
    method = _choice(method, "method", EDGE_METHODS)
    points = _choice(points, "points", IG_POINTS)
    if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    check_metric(metric, "edge_attribution")
    layout = _Layout(model)
    check_differentiable(model, "edge_attribution")
    clean_ids, corrupted_ids = same_shape_ids(clean, corrupted)
    corrupted_out, cache = model.run_with_cache(corrupted_ids, names_filter=layout.source_hooks, **forward_kwargs)
    corrupted_value = _number(metric(corrupted_out))
    diff = -layout.outputs(cache)  # a(clean) - a(corrupted), filled below
    if method == "eap":
        clean_value, _, acts, grads = run_with_grads(model, clean_ids, metric, layout.source_hooks,
                                                     grad_names=layout.read_hooks, **forward_kwargs)
        g = layout.gradients(grads)
    else:
        clean_out, acts = model.run_with_cache(clean_ids, names_filter=layout.source_hooks, **forward_kwargs)
        clean_value = _number(metric(clean_out))
        e_clean, e_corrupted = np.asarray(acts[EMBED]), np.asarray(cache[EMBED])
        ks = range(1, steps + 1) if points == "riemann_right" else range(steps)
        g = None
        for k in ks:
            embed = (e_corrupted + (k / steps) * (e_clean - e_corrupted)).astype(e_clean.dtype)

            def interpolate(a, name, embed=embed):
                return embed

            _, _, _, grads = run_with_grads(model, clean_ids, metric, [], grad_names=layout.read_hooks,
                                            fwd_hooks=[(EMBED, interpolate)], **forward_kwargs)
            gk = layout.gradients(grads)
            g = gk if g is None else g + gk
        g /= steps
    diff += layout.outputs(acts)
    U, V = len(layout.sources), len(layout.targets)
    scores = diff.reshape(U, -1) @ g.reshape(V, -1).T
    scores[~layout.real] = np.nan
    return EdgeGraph(layout.sources, layout.targets, scores, layout.real.copy(), method=method, steps=steps,
                     points=points if method == "eap-ig" else None, clean_value=clean_value,
                     corrupted_value=corrupted_value)


def circuit(graph: EdgeGraph, top_n: int, *, absolute: bool = True, prune: bool = True) -> EdgeGraph:
    """The ``top_n`` highest-scoring edges of ``graph`` (by ``|score|``, or by score with
    ``absolute=False``), then (``prune``) without the edges that cannot matter: those from
    a component none of whose inputs is in the circuit (its output is then the corrupted
    one) and those into a component whose output reaches the logits through no edge of the
    circuit. So the result may hold fewer than ``top_n`` edges.

    >>> from attnlab.models import GPT2, GPT2Config
    >>> from attnlab.inspect import logit_diff
    >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2),
    ...              rng=np.random.default_rng(0))
    >>> graph = edge_attribution(model, np.array([[1, 2, 3, 4]]), np.array([[1, 5, 3, 4]]), logit_diff(7, 8))
    >>> len(circuit(graph, top_n=10)) <= 10
    True
    """
    if not isinstance(graph, EdgeGraph):
        raise TypeError(f"graph must be an EdgeGraph (edge_attribution's result), got {type(graph).__name__}")
    if isinstance(top_n, bool) or not isinstance(top_n, int | np.integer) or top_n < 0:
        raise ValueError(f"top_n must be an int >= 0, got {top_n!r}")
    key = np.where(graph.included, np.abs(graph.scores) if absolute else graph.scores, -np.inf)
    order = np.argsort(-key, axis=None, kind="stable")[:int(top_n)]
    chosen = np.zeros_like(graph.included)
    chosen.flat[order] = True
    chosen &= graph.included
    return graph.with_edges(_pruned(graph, chosen) if prune else chosen)


def _pruned(graph: EdgeGraph, chosen: np.ndarray) -> np.ndarray:
    """``chosen`` without the edges whose source is never reached from the input through the
    circuit, or whose target never reaches the logits through it."""
    heads_of: dict[str, list[str]] = {}  # target -> the source components it feeds
    for t in graph.targets:
        name = t.partition("<")[0]
        if t == "logits":
            heads_of[t] = []
        elif ".kv" in name:  # a key/value head feeds every query head of its group
            layer, g = name.split(".kv")
            H = sum(1 for s in graph.sources if s.startswith(layer + ".h"))
            Hkv = sum(1 for x in graph.targets if x.startswith(layer + ".kv") and x.endswith("<k>"))
            per = H // Hkv
            heads_of[t] = [f"{layer}.h{h}" for h in range(int(g) * per, (int(g) + 1) * per)]
        else:
            heads_of[t] = [name]
    src = {s: i for i, s in enumerate(graph.sources)}
    while True:
        reached = {"input"}
        for j, t in enumerate(graph.targets):  # targets in forward order: a source is done before its readers
            if any(chosen[src[s], j] for s in reached):
                reached.update(heads_of[t])
        useful = {"logits"}
        for j in range(len(graph.targets) - 1, -1, -1):
            t = graph.targets[j]
            if t == "logits" or any(h in useful for h in heads_of[t]):
                useful.update(graph.sources[i] for i in np.nonzero(chosen[:, j])[0])
        keep = chosen.copy()
        for i, s in enumerate(graph.sources):
            if s not in reached or s not in useful:
                keep[i] = False
        for j, t in enumerate(graph.targets):
            if t != "logits" and not any(h in useful for h in heads_of[t]):
                keep[:, j] = False
        if (keep == chosen).all():
            return keep
        chosen = keep


@dataclass(frozen=True)
class Faithfulness:
    """What running a circuit recovers.

    Attributes:
        share: ``(circuit - corrupted) / (clean - corrupted)``: 1 recovers the clean run's
            metric, 0 the corrupted run's (NaN when the two runs' metrics are equal).
        circuit, clean, corrupted: the metric with every edge outside the circuit patched,
            on the clean run and on the corrupted run.
        edges: the number of edges in the circuit.
    """

    share: float
    circuit: float
    clean: float
    corrupted: float
    edges: int

    def __float__(self) -> float:
        return self.share


def faithfulness(
    model,
    circuit: EdgeGraph | Iterable[tuple[str, str]],
    clean: np.ndarray,
    corrupted: np.ndarray,
    metric: Callable,
    **forward_kwargs,
) -> Faithfulness:
    """Run the model on ``clean`` with every edge outside ``circuit`` patched to its
    corrupted value, and report the share of the metric it recovers.

    One run on ``corrupted`` records every source's output; the run on ``clean`` then
    gives each target (through the blocks' ``hook_q_input``, ``hook_k_input``,
    ``hook_v_input``, ``hook_mlp_in`` and the last ``hook_resid_post``) its live input plus
    ``a_u(corrupted) - a_u(this run)`` for every source ``u`` whose edge into it is not in
    the circuit: a real forward pass through hooks, nothing linearised. The whole graph
    gives the clean run (share 1); no edge gives the corrupted run (share 0).

    Args:
        model: as :func:`edge_attribution`'s (forward passes only).
        circuit: an :class:`EdgeGraph` (its edges) or ``(source, target)`` pairs.
        clean, corrupted: token ids of the same shape.
        metric: output -> number (no gradient needed).

    Returns:
        A :class:`Faithfulness` (``float(result)`` is the share).

    >>> from attnlab.models import GPT2, GPT2Config
    >>> from attnlab.inspect import logit_diff
    >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2),
    ...              rng=np.random.default_rng(0))
    >>> clean, corrupted, metric = np.array([[1, 2, 3, 4]]), np.array([[1, 5, 3, 4]]), logit_diff(7, 8)
    >>> graph = edge_attribution(model, clean, corrupted, metric)
    >>> round(faithfulness(model, graph, clean, corrupted, metric).share, 6)
    1.0
    >>> round(faithfulness(model, [], clean, corrupted, metric).share, 6)
    0.0
    """
    if not callable(metric):
        raise TypeError(f"metric must be a callable (output -> number), got {type(metric).__name__}")
    layout = _Layout(model)
    clean_ids, corrupted_ids = same_shape_ids(clean, corrupted)
    wanted = np.zeros_like(layout.real)
    if isinstance(circuit, EdgeGraph):
        if circuit.sources != layout.sources or circuit.targets != layout.targets:
            raise ValueError("circuit is the graph of another model (its nodes differ from this model's)")
        wanted |= circuit.included
    else:
        probe = EdgeGraph(layout.sources, layout.targets, np.where(layout.real, 0.0, np.nan), layout.real,
                          method="", steps=0, points=None, clean_value=math.nan, corrupted_value=math.nan)
        if isinstance(circuit, str) or not isinstance(circuit, Iterable):
            raise TypeError(f"circuit must be an EdgeGraph or (source, target) pairs, got {type(circuit).__name__}")
        for edge in circuit:
            wanted[probe.index(tuple(edge) if isinstance(edge, list) else edge)] = True
    corrupted_out, cache = model.run_with_cache(corrupted_ids, names_filter=layout.source_hooks, **forward_kwargs)
    corrupted_value = _number(metric(corrupted_out))
    clean_value = _number(metric(model(clean_ids, **forward_kwargs)))
    a_corrupted = layout.outputs(cache)  # (U, B, T, E)
    outside = layout.real & ~wanted  # (U, V): the edges to patch
    live: list[np.ndarray | None] = [None] * len(layout.sources)

    def record_embed(a, name):
        live[0] = _batched(a)

    def record_heads(l):
        def record(z, name):
            base = 1 + l * (layout.H + 1)
            live[base:base + layout.H] = list(np.einsum("bthd,hde->hbte", np.asarray(z, np.float64), layout.W_O[l]))
        return record

    def record_mlp(l):
        def record(a, name):
            live[(l + 1) * (layout.H + 1)] = _batched(a)
        return record

    hooks = [(EMBED, record_embed)]
    for l in range(layout.N):
        hooks += [(Z.format(i=l), record_heads(l)), (MLP_OUT.format(i=l), record_mlp(l))]
    for r in hooks:
        r[1].reads_only = True
    columns: dict[str, list[int]] = {}
    for j, (name, _) in enumerate(layout.reads):
        columns.setdefault(name, []).append(j)
    for name, cols in columns.items():
        if not outside[:, cols].any():
            continue  # every edge into these targets is in the circuit: nothing to patch

        def patch(a, hook_name, cols=cols):
            rows = np.nonzero(outside[:, cols].any(axis=1))[0]
            delta = np.stack([a_corrupted[u] - live[u] for u in rows])  # (u, B, T, E)
            update = np.einsum("ubte,uh->bthe", delta, outside[rows][:, cols].astype(np.float64))  # (B, T, n, E)
            if a.ndim != 4:  # one target reads this point (an MLP, the logits): (B, T, E) or unbatched (T, E)
                update = update[:, :, 0] if a.ndim == 3 else update[0, :, 0]
            return (a + update).astype(a.dtype, copy=False)

        hooks.append((name, patch))
    circuit_value = _number(metric(model.run_with_hooks(clean_ids, fwd_hooks=hooks, **forward_kwargs)))
    gap = clean_value - corrupted_value
    share = (circuit_value - corrupted_value) / gap if gap != 0 else math.nan
    return Faithfulness(share=share, circuit=circuit_value, clean=clean_value, corrupted=corrupted_value,
                        edges=int(wanted.sum()))
