"""Looking inside a model through its hook points: the logit lens, direct logit attribution,
head ablation, activation patching, head detectors and attention rollout; and, from
gradients (:mod:`attnlab.inspect.metrics`), attribution patching, edge attribution with
circuits and their faithfulness, and input attribution.

Each is a plain function over a model and its inputs, or over the cache of
``model.run_with_cache(...)``; every one reads or replaces named activations
(``blocks.{i}.hook_resid_pre``, ``blocks.{i}.attn.hook_z``, ``blocks.{i}.attn.hook_pattern``,
...) through ``run_with_cache`` and ``run_with_hooks``, never by running a layer again.
The numbers are TransformerLens's (``accumulated_resid`` after ``ln_final`` and the
unembedding, ``apply_ln_to_stack``, ``detect_head``'s ``"mul"`` score), computed in NumPy.

Shapes: ``N`` blocks, ``H`` query heads, ``B`` sequences, ``T`` tokens, ``V`` vocabulary.
Blocks count from 0, as the hook names do: block ``i`` is attnlab's layer ``i + 1`` (layer 0
is the embeddings).

==================================== ============================== =========================
function                             reads                          returns
==================================== ============================== =========================
:func:`logit_lens`                   cache: resid_pre 0, resid_post ``(N + 1, B, T, V)``
:func:`direct_logit_attribution`     cache: embed, z, mlp_out, ...  :class:`LogitAttribution`
:func:`ablate_heads`                 runs the model, hook_z         the model's output
:func:`activation_patching`          runs the model N x T times     ``(N, T)`` or ``(N, H)``
:func:`detect_heads`                 runs the model, hook_pattern   ``(N, H)``
:func:`attention_rollout`            cache: hook_pattern            ``(N, B, T, T)``
:func:`attribution_patching`         2 forward, 1 backward pass     ``(N, T)`` or ``(N, H)``
:func:`edge_attribution`             2 + steps passes, q/k/v inputs :class:`EdgeGraph`
:func:`faithfulness`                 2 forward passes, hooks        :class:`Faithfulness`
:func:`input_attribution`            hook_embed's gradient          :class:`InputAttribution`
==================================== ============================== =========================
"""

from attnlab.inspect.attribution import ATTRIBUTION_METHODS, attribution_patching
from attnlab.inspect.edges import EDGE_METHODS, EdgeGraph, Faithfulness, circuit, edge_attribution, faithfulness
from attnlab.inspect.heads import HEAD_KINDS, attention_rollout, detect_heads, detection_pattern
from attnlab.inspect.inputs import INPUT_METHODS, INTEGRATION_RULES, InputAttribution, input_attribution
from attnlab.inspect.interventions import ABLATIONS, PATCH_HOOKS, ablate_heads, activation_patching
from attnlab.inspect.lens import LogitAttribution, direct_logit_attribution, logit_lens, logit_lens_top
from attnlab.inspect.metrics import Metric, cross_entropy, log_prob, logit_diff, probability

__all__ = [
    "ABLATIONS",
    "ATTRIBUTION_METHODS",
    "EDGE_METHODS",
    "EdgeGraph",
    "Faithfulness",
    "INPUT_METHODS",
    "INTEGRATION_RULES",
    "InputAttribution",
    "input_attribution",
    "Metric",
    "attribution_patching",
    "circuit",
    "cross_entropy",
    "edge_attribution",
    "faithfulness",
    "log_prob",
    "logit_diff",
    "probability",
    "HEAD_KINDS",
    "PATCH_HOOKS",
    "LogitAttribution",
    "ablate_heads",
    "activation_patching",
    "attention_rollout",
    "detect_heads",
    "detection_pattern",
    "logit_lens_top",
    "direct_logit_attribution",
    "logit_lens",
]
