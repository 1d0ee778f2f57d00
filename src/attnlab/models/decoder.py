"""What every causal language model shares, written once: :class:`CausalLM`.

A family's module (:mod:`attnlab.models.gpt2`, :mod:`attnlab.models.llama`) arranges the
blocks and says how tokens are embedded (``_embed``), what the unembedding is (``W_U``)
and how long a sequence may be (``max_positions``); the forward pass and its backward
pass, the cache, generation, the recorded views (``inspect``, ``trace``) and the tokenizer
methods come from here. Shapes: ``B`` sequences, ``T`` tokens, ``D`` width, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from attnlab._validation import layer_number, shape_error
from attnlab.models.generate import check_token_ids, decoder_backward, decoder_forward, generate, generate_stream
from attnlab.nn import _context
from attnlab.nn import functional as F
from attnlab.nn.attention import KVCache
from attnlab.nn.hooks import record_layers
from attnlab.nn.module import Module

__all__ = ["CausalLM", "CausalLMOutput", "decode_stream"]


@dataclass
class CausalLMOutput:
    """Everything a causal language model's :meth:`~CausalLM.inspect` records for a batch
    (every decoder family's; ``GPT2Output`` is its older name).

    Attributes:
        logits: ``(B, T, V)``.
        hidden_states: ``(n_layers + 1, B, T, D)``: layer 0 is the embeddings (GPT-2's
            token + position), layer ``k`` the output of block ``k`` (before the final norm;
            ``transformers``' last hidden state is after it).
        attentions: ``(n_layers, B, H, T, T)``, each row a causal map summing to 1 (a
            padded query's row is all 0: it has no real token to attend to).
    """

    logits: np.ndarray
    hidden_states: np.ndarray
    attentions: np.ndarray


class CausalLM(Module):
    """The shared half of a causal language model (see the module docstring).

    A subclass has ``tok_emb``, ``blocks`` (a Module of ``TransformerBlock``\\ s), ``ln_f``,
    ``config.vocab_size`` and ``tokenizer``, and defines ``_embed(ids, positions)`` and its
    backward ``_embed_backward(grad)``, :attr:`W_U`, the parameter the output layer
    multiplies by (``_out_param``) and :attr:`max_positions` (named ``_positions_name`` in
    errors).
    """

    _hook_alias = {"ln_f": "ln_final"}
    #: Activation checkpointing (set it on the model: ``model.checkpoint_blocks = True``): a
    #: training forward pass without hooks keeps each block's input only, and the backward
    #: pass recomputes each block before going through it (about one more forward pass of
    #: time for far less memory; the gradients are the same).
    checkpoint_blocks = False
    _positions_name = "context_length"
    _ids_name = "input_ids"  # the token ids' argument, as errors name it
    _output_class = CausalLMOutput  # what inspect returns

    @property
    def dtype(self) -> np.dtype:
        return self.tok_emb.weight.dtype

    @property
    def layers(self) -> list:
        """The transformer blocks, first to last (layer ``k`` is ``layers[k - 1]``)."""
        return list(self.blocks._modules.values())

    @property
    def max_positions(self) -> int:
        """The longest sequence the model takes."""
        raise NotImplementedError

    @property
    def W_U(self) -> np.ndarray:
        """The unembedding ``(D, V)``: ``logits = ln_final(h) @ W_U``."""
        raise NotImplementedError

    @property
    def b_U(self) -> None:
        """The output layer's bias: none in these families."""
        return None

    @property
    def ln_final(self) -> Module:
        """The final norm (hook name ``ln_final``)."""
        return self.ln_f

    def new_cache(self, *, dtype=None) -> list[KVCache]:
        """An empty key/value cache, one :class:`~attnlab.nn.KVCache` per block, for
        :meth:`forward` ``(..., cache=...)``; ``dtype`` is its storage dtype (None: the
        keys' own; ``"float16"``: half the memory, ``"int8"``: about a quarter, see
        :class:`~attnlab.nn.KVCache`)."""
        return [KVCache(dtype=dtype) for _ in self.layers]

    def unembed(self, h: np.ndarray) -> np.ndarray:
        """The output layer: ``(..., D) -> (..., V)`` logits of a normalized residual (after
        :attr:`ln_final`)."""
        return F.linear(h, self._W_out)

    @property
    def _W_out(self):
        """The output layer's weight ``(V, D)`` as stored (a family may keep it quantized)."""
        return self.W_U.T

    def _logits(self, h: np.ndarray) -> np.ndarray:
        return self.unembed(self.ln_f(h))

    def _run(self, input_ids, attention_mask, cache, logits_to_keep=None):
        kept: dict = {}

        def head(h):  # keeps the final norm's output for the output weight's gradient (unless frozen)
            hn = self.ln_f(h)
            logits = self.unembed(hn)
            kept.update(hn=hn if self._out_param.requires_grad else None, **self._head_saved(logits))
            return logits

        keeping = self._keeping()
        checkpoint = {} if keeping and self.checkpoint_blocks and cache is None and self.training \
            and _context.current_hooks() is None else None
        logits = decoder_forward(
            input_ids, attention_mask, cache, embed=self._embed, blocks=self.layers,
            head=head if keeping else self._logits, vocab_size=self.config.vocab_size,
            n_positions=self.max_positions, positions_name=self._positions_name, ids_name=self._ids_name,
            logits_to_keep=logits_to_keep, checkpoint=checkpoint,
        )
        self._save_call(shape=logits.shape, tokens=np.shape(input_ids)[-1], cached=cache is not None,
                        checkpoint=checkpoint, **kept)
        return logits

    # ------------------------------------------------------------------ backward

    def _head_saved(self, logits: np.ndarray) -> dict:
        """What the output layer's backward pass needs of the logits (a family whose
        output layer does more than a product keeps it here)."""
        return {}

    @property
    def _out_param(self):
        """The :class:`~attnlab.nn.Parameter` the output layer multiplies by (``_W_out``):
        the token embedding's when tied."""
        raise NotImplementedError

    def _unembed_backward(self, grad: np.ndarray, saved: dict) -> np.ndarray:
        """The output layer's backward pass: the gradient of the final norm's output; the
        weight's gradient accumulates (the token embedding's, when tied)."""
        p = self._out_param
        gh, gw, _ = F.linear_backward(grad, saved["hn"], self._W_out, has_bias=False,
                                      weight_grad=p.requires_grad and saved["hn"] is not None)
        if gw is not None:
            p.accumulate(gw, owned=True)
        return gh

    def _embed_backward(self, grad: np.ndarray) -> None:
        """The embeddings' backward pass (the gradient of ``blocks.0.hook_resid_pre``)."""
        raise NotImplementedError

    def backward(self, grad_out: np.ndarray) -> None:
        """Backpropagate ``grad_out``, the gradient of a loss with respect to the logits of
        the last forward pass, ``(B, T, V)`` (``(T, V)`` unbatched; ``(B, logits_to_keep,
        V)``), of the weights' dtype: every parameter's gradient is **added** to its
        ``.grad`` (the tied token embedding's gets both uses); token ids have none.

        Needs a forward pass in training mode (:meth:`train`; eval mode, the default after
        loading, keeps nothing for backward). One backward per forward: the pass frees what
        the forward kept. The backward hooks attached around that forward pass run here
        (see :mod:`attnlab.nn.hooks`); ``hook_embed``'s gradient is the loss's gradient with
        respect to the token embeddings.

        Raises:
            RuntimeError: no forward pass in training mode before it, or a second backward
                after one forward pass, or a forward pass with a key/value cache.
            ValueError, TypeError: ``grad_out`` of the wrong shape or dtype (named, with the
                shape and dtype needed); quantized weights (load the model dequantized).

        >>> from attnlab.models import GPT2, GPT2Config
        >>> model = GPT2(GPT2Config(vocab_size=20, n_positions=8, n_embd=8, n_layer=1, n_head=2),
        ...              rng=np.random.default_rng(0)).train()
        >>> logits = model(np.array([[1, 2, 3]]))
        >>> model.backward(np.ones_like(logits))
        >>> model.tok_emb.weight.grad.shape
        (20, 8)
        """
        c, g = self._start_backward(grad_out)
        decoder_backward(self.ln_f.backward(self._unembed_backward(g, c)), c["tokens"], blocks=self.layers,
                         embed_backward=self._embed_backward, checkpoint=c.get("checkpoint"))

    def forward(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray | None = None,
        *,
        cache: list[KVCache] | None = None,
        logits_to_keep: int | None = None,
    ) -> np.ndarray:
        """``input_ids (B, T)`` (or ``(T,)``) -> ``logits (B, T, V)``.

        Args:
            input_ids: integer token ids in ``0..V-1``.
            attention_mask: ``(B, P + T)``, 1 (True) for real tokens, 0 for padding, the
                ``P`` cached tokens included. Padded keys take no part; positions count
                the real tokens (``cumsum(mask) - 1``, as ``transformers``' ``generate``),
                so a left-padded sequence's real tokens get the logits of the unpadded one.
                Logits at padded positions mean nothing.
            cache: from :meth:`new_cache`: ``input_ids`` are the tokens after the cached ones;
                their keys and values are appended, and the logits equal those of the
                whole sequence run at once.
            logits_to_keep: only the last this many positions' logits (None: all).
        """
        return self._run(input_ids, attention_mask, cache, logits_to_keep)

    def inspect(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None):
        """The logits with every layer's hidden states and attention maps, recorded through
        the hook points in one forward pass (``output_hidden_states=True,
        output_attentions=True`` in ``transformers``)."""
        logits, hidden, maps = record_layers(self, lambda: self._run(input_ids, attention_mask, None))
        return self._output_class(logits, hidden, maps)

    def generate(
        self,
        input_ids: np.ndarray,
        max_new_tokens: int,
        *,
        attention_mask: np.ndarray | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        rng: np.random.Generator | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        cache_dtype=None,
    ) -> np.ndarray:
        """The prompts followed by up to ``max_new_tokens`` new tokens: ``(B, T + n)``.

        The prompt runs once and fills a per-layer key/value cache; each step runs only the
        token just chosen, whose query attends bottom-right causally over the cached keys.
        Greedy when ``temperature == 0`` (token for token as ``transformers``'
        ``generate(do_sample=False)``); otherwise a sample from ``softmax(logits /
        temperature)`` (among the ``top_k`` likeliest) drawn with ``rng``. A batch of
        prompts of different lengths is left-padded, with ``attention_mask`` (1 = real
        token). With ``eos_token_id`` a finished row continues with it and generation stops
        when every row has finished. Hooks attached with ``model.hooks(...)`` run once per
        step. ``cache_dtype`` stores the cache in another dtype (``"float16"``: half the
        memory, and faster long generations with weights kept quantized; ``"int8"``: a
        code a value and a scale a token and head, about a quarter; see
        :class:`~attnlab.nn.KVCache`). See :func:`attnlab.models.generate.generate`.

        Raises:
            ValueError: token ids outside the vocabulary, the prompt plus
                ``max_new_tokens`` longer than the context, a mask that is not 0/1 or not
                left-padded, a negative temperature, ``top_k`` without sampling, a
                ``cache_dtype`` that is not one of :data:`attnlab.nn.attention.CACHE_DTYPES`.
        """
        return generate(
            self, input_ids, max_new_tokens, vocab_size=self.config.vocab_size, n_positions=self.max_positions,
            positions_name=self._positions_name, attention_mask=attention_mask, temperature=temperature,
            top_k=top_k, rng=rng, eos_token_id=eos_token_id, cache_dtype=cache_dtype,
        )

    def stream(
        self,
        input_ids: np.ndarray,
        max_new_tokens: int,
        *,
        attention_mask: np.ndarray | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        rng: np.random.Generator | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        cache_dtype=None,
    ) -> Iterator:
        """:meth:`generate`'s new tokens one at a time, each as soon as it is chosen: ``(B,)``
        int64 per step, or an ``int`` for one prompt ``(T,)``. The arguments are checked
        when it is called; see :func:`attnlab.models.generate.generate_stream`."""
        return generate_stream(
            self, input_ids, max_new_tokens, vocab_size=self.config.vocab_size, n_positions=self.max_positions,
            positions_name=self._positions_name, attention_mask=attention_mask, temperature=temperature,
            top_k=top_k, rng=rng, eos_token_id=eos_token_id, cache_dtype=cache_dtype,
        )

    def stream_text(
        self,
        prompt: str,
        max_new_tokens: int,
        *,
        chat: bool | None = None,
        system: str | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        rng: np.random.Generator | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        cache_dtype=None,
    ) -> Iterator[str]:
        """The continuation of one text, as pieces of text as soon as they are decoded.

        With ``chat`` (the default when the model has a chat template) the prompt is a user
        message put through the template and the pieces are the assistant's answer.
        Generation stops at ``eos_token_id`` (default: the config's), which is left out. A
        character split across tokens (UTF-8 bytes of byte-level tokens) comes out whole,
        once its last byte is made. Joined, the pieces are :meth:`generate_text`'s result
        (without the prompt). The other options are :meth:`generate`'s.
        """
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        template = getattr(self, "chat_template", None)
        chat = template is not None if chat is None else bool(chat)
        text = self.chat_prompt(prompt, system=system) if chat else prompt
        ids, _ = self.encode(text)
        if eos_token_id is None:
            eos_token_id = self.config.eos_token_id
        tokens = self.stream(ids, max_new_tokens, temperature=temperature, top_k=top_k, rng=rng,
                             eos_token_id=eos_token_id, cache_dtype=cache_dtype)
        return decode_stream(self._tokenizer(), tokens, context=[] if chat else ids[-8:].tolist(),
                             eos_token_id=eos_token_id, skip_special_tokens=chat)

    # ------------------------------------------------------------------ text

    def _tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"this {type(self).__name__} has no tokenizer: load a folder with tokenizer.json "
                             "(or a .gguf file) with from_pretrained, or pass tokenizer=")
        return self.tokenizer

    def encode(self, text: str) -> tuple[np.ndarray, list[str]]:
        """``(ids (T,), tokens)`` of ``text`` with the model's tokenizer (tokens as the
        tokenizer writes them: byte-level BPE marks a leading space with ``Ġ``;
        :func:`attnlab.text.readable_tokens` shows them as text)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        enc = self._tokenizer().encode(text)
        if not enc.ids:
            raise ValueError("text is empty: it has no tokens")
        return np.array(enc.ids, dtype=np.int64), list(enc.tokens)

    def _one_sequence(self, ids_or_text) -> tuple[np.ndarray, list[str]]:
        if isinstance(ids_or_text, str):
            return self.encode(ids_or_text)
        ids = check_token_ids(ids_or_text, self.config.vocab_size, "ids")
        if ids.ndim != 1:
            raise shape_error("ids", ids.shape, "(T,): one sequence")
        tokens = [self.tokenizer.id_to_token(int(i)) or str(int(i)) for i in ids] if self.tokenizer \
            else [str(int(i)) for i in ids]
        return ids, tokens

    def trace(self, ids_or_text, *, layer: int = -1, head: int | None = None, tokens=None):
        """The step-by-step :class:`~attnlab.Trace` of block ``layer``'s causal attention on
        one sequence, recorded through the hook points of one forward pass.

        Args:
            ids_or_text: ``(T,)`` token ids, or a text (needs the tokenizer).
            layer: ``1..n`` (the block whose attention is traced), negatives from the end;
                0 (the embeddings) has no attention.
            head: keep only this head's per-head steps (``None``: every head).
            tokens: ``T`` labels (default: the tokenizer's tokens as a person reads them,
                ``'␣Paris'`` for ``'ĠParis'``, else the ids).
        """
        from attnlab.trace import trace_model

        ids, labels = self._one_sequence(ids_or_text)
        if self.tokenizer is not None:
            from attnlab.text.tokens import readable_tokens, token_scheme

            labels = readable_tokens(labels, token_scheme(self.tokenizer))
        k = layer_number(layer, len(self.layers), embeddings=False)
        if len(ids) > self.max_positions:
            raise shape_error("ids", ids.shape, f"(T,) with T <= {self._positions_name}={self.max_positions}")
        return trace_model(self, k, lambda: self._run(ids, None, None), tokens=labels if tokens is None else tokens,
                           head=head)


def decode_stream(tokenizer, tokens, *, context: Sequence[int] = (), eos_token_id=None,
                  skip_special_tokens: bool = False) -> Iterator[str]:
    """The text of a stream of token ids (``int`` each), piece by piece as it comes.

    Each piece is the new text since the last one, decoded after ``context`` (the prompt's
    last tokens: a leading space, or a merge at the boundary, then comes out as in the whole
    text). A character whose UTF-8 bytes span several byte-level tokens waits for its last
    byte (the decoded text then ends in U+FFFD); ``eos_token_id`` (one or several) ends
    the stream and is left out. Joined, the pieces are the decoded tokens.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (``decode(ids, skip_special_tokens=...)``).
        tokens: the token ids, e.g. :meth:`CausalLM.stream`'s for one prompt.
        context: ids decoded before the tokens and left out of the pieces.
        eos_token_id: the end token(s), or None.
        skip_special_tokens: leave special tokens out of the text.
    """
    stop = set(np.atleast_1d(eos_token_id).tolist()) if eos_token_id is not None else set()
    context = [int(t) for t in context]
    base = tokenizer.decode(context, skip_special_tokens=skip_special_tokens) if context else ""
    new: list[int] = []
    sent = 0
    for token in tokens:
        if int(token) in stop:
            break
        new.append(int(token))
        text = tokenizer.decode(context + new, skip_special_tokens=skip_special_tokens)[len(base):]
        if text.endswith("\ufffd"):
            continue
        if len(text) > sent:
            yield text[sent:]
            sent = len(text)
    text = tokenizer.decode(context + new, skip_special_tokens=skip_special_tokens)[len(base):] if new else ""
    if len(text) > sent:
        yield text[sent:]
