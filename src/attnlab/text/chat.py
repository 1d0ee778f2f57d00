"""Chat templates: the Jinja template an instruct model ships, run in jinja2's sandbox.

A chat template comes inside a model file (a GGUF's ``tokenizer.chat_template``, a
``tokenizer_config.json``): it is untrusted input. It runs in
``jinja2.sandbox.ImmutableSandboxedEnvironment`` only (never a plain ``Environment``): no
attribute that starts with an underscore, no Python internals, no mutation of the data it is
given; the messages are rebuilt from plain JSON types first. The environment matches what
transformers' ``apply_chat_template`` gives templates: ``trim_blocks``, ``lstrip_blocks``,
the ``loopcontrols`` extension, ``raise_exception(message)``, ``strftime_now(format)``, a
``tojson`` filter that keeps non-ASCII text, and a ``namespace`` that refuses underscore
names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

__all__ = ["ChatTemplate", "apply_chat_template"]


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the Jinja template text.

    Raises:
        ValueError: a template that does not compile (the message says where).
        ImportError: jinja2 is missing (the ``gguf`` extra installs it).

    >>> t = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    >>> t.render([{"role": "user", "content": "hi"}])
    '<user>hi'
    """

    def __init__(self, source: str):
        if not isinstance(source, str):
            raise TypeError(f"a chat template must be a str, got {type(source).__name__}")
        self.source = source
        env = _environment()
        import jinja2

        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template does not compile: {_describe(exc)}") from None

    def render(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = False, **variables) -> str:
        """The conversation as the model's prompt text.

        Args:
            messages: dicts with ``"role"`` and ``"content"`` (plain JSON values only).
            add_generation_prompt: end with the header of an assistant turn, so that the
                model writes the answer.
            **variables: other template variables (``bos_token``, ``eos_token``, ``tools``…).

        Raises:
            ValueError: the template fails (its ``raise_exception``, an undefined value, a
                type error), or tries to reach something the sandbox forbids: one message
                that says which.
        """
        import jinja2

        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
            raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        data = {k: _plain(v) for k, v in variables.items()}
        try:
            return self._template.render(messages=_plain(list(messages)),
                                         add_generation_prompt=bool(add_generation_prompt), **data)
        except jinja2.exceptions.SecurityError as exc:
            raise ValueError(f"the chat template tried something the sandbox forbids: {exc}") from None
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template failed: {_describe(exc)}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError,
                RecursionError) as exc:
            raise ValueError(f"the chat template failed: {type(exc).__name__}: {exc}") from None


def apply_chat_template(template: str, messages: Sequence[Mapping], *, add_generation_prompt: bool = False,
                        **variables) -> str:
    """Render ``messages`` with the chat template ``template`` (see :class:`ChatTemplate`).

    >>> apply_chat_template("{{ messages[0]['content'] | upper }}", [{"role": "user", "content": "hi"}])
    'HI'
    """
    return ChatTemplate(template).render(messages, add_generation_prompt=add_generation_prompt, **variables)


def _describe(exc) -> str:
    line = getattr(exc, "lineno", None)
    return f"{exc.message if getattr(exc, 'message', None) else exc}" + (f" (line {line})" if line else "")


def _plain(value):
    """``value`` rebuilt from plain JSON types (str, int, float, bool, None, dict, list);
    anything else becomes a placeholder naming its type, so that no object with methods
    reaches the template."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:  # a NumPy scalar
        return _plain(value.item())
    return f"<{type(value).__name__}>"


_ENV = None


def _environment():
    """The one sandboxed environment (built once)."""
    global _ENV
    if _ENV is not None:
        return _ENV
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError("chat templates need jinja2: pip install 'attnlab[gguf]'") from None
    from datetime import datetime

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(str(message))

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(str(fmt))

    class SafeNamespace(jinja2.utils.Namespace):
        """``namespace(...)`` whose attribute names may not start with an underscore."""

        def __init__(*args, **kwargs):
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                SafeNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            SafeNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    class Sandbox(ImmutableSandboxedEnvironment):
        """jinja2's immutable sandbox, where reaching an unsafe attribute raises at once (the
        stock sandbox gives an undefined value, which may render as an empty string)."""

        def unsafe_undefined(self, obj, attribute):
            raise jinja2.exceptions.SecurityError(
                f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = SafeNamespace
    _ENV = env
    return env
