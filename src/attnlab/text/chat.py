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

A template also runs inside bounds, compiled and rendered: at most :data:`MAX_TEMPLATE_CHARS`
of source; at most ``max_steps`` steps (loop iterations and calls, default
:data:`MAX_STEPS`) and ``max_seconds`` of rendering (default :data:`MAX_SECONDS`); and at
most :data:`MAX_TEXT_BYTES` plus :data:`TEXT_PER_INPUT` times the length of the text it is
given, counted over every string it makes (output, ``~`` and ``+`` joins, ``*`` repeats, filter
and method results). Operators and filters whose result could pass that bound are checked
before they run, never folded into constants while the template compiles. A template past a
bound is refused with :class:`TemplateBoundError`.
"""

from __future__ import annotations

import contextvars
import json
import math
import re
import time
from collections.abc import Mapping, Sequence

__all__ = ["MAX_SECONDS", "MAX_STEPS", "MAX_TEMPLATE_CHARS", "MAX_TEXT_BYTES", "TEXT_PER_INPUT", "ChatTemplate",
           "ChatTemplateError", "TemplateBoundError", "apply_chat_template"]

#: The longest template source compiled (real chat templates are a few kilobytes).
MAX_TEMPLATE_CHARS = 1 << 20
#: Loop iterations and calls a render may take.
MAX_STEPS = 1_000_000
#: Seconds a render may take.
MAX_SECONDS = 2.0
#: Characters of strings a render may make, beyond :data:`TEXT_PER_INPUT` per input character.
MAX_TEXT_BYTES = 16 << 20
#: Characters a render may make per character of the messages and variables it is given.
TEXT_PER_INPUT = 16
#: The largest integer (in bits) an operator may make.
_MAX_INT_BITS = 1 << 16
#: The deepest nesting of the messages and variables given to a template.
_MAX_DEPTH = 64


class ChatTemplateError(ValueError):
    """A chat template that does not compile, fails, or tries what the sandbox forbids."""


class TemplateBoundError(ChatTemplateError):
    """A chat template past one of its bounds (steps, seconds, text made, source size)."""


class ChatTemplate:
    """A compiled chat template, run in the sandbox within bounds.

    Args:
        source: the Jinja template text (at most :data:`MAX_TEMPLATE_CHARS` characters).
        max_steps: the loop iterations and calls one render may take.
        max_seconds: the time one render may take.

    Raises:
        ChatTemplateError: a template that does not compile (the message says where).
        TemplateBoundError: a source longer than :data:`MAX_TEMPLATE_CHARS`.
        ImportError: jinja2 is missing (the ``gguf`` extra installs it).

    >>> t = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    >>> t.render([{"role": "user", "content": "hi"}])
    '<user>hi'
    >>> ChatTemplate("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}").render([])
    Traceback (most recent call last):
    ...
    attnlab.text.chat.TemplateBoundError: the chat template took more than 1,000,000 steps (loop iterations and calls)
    """

    def __init__(self, source: str, *, max_steps: int = MAX_STEPS, max_seconds: float = MAX_SECONDS):
        if not isinstance(source, str):
            raise TypeError(f"a chat template must be a str, got {type(source).__name__}")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise TemplateBoundError(f"the chat template has {len(source):,} characters; at most "
                                     f"{MAX_TEMPLATE_CHARS:,} are compiled")
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
        if isinstance(max_seconds, bool) or not isinstance(max_seconds, int | float) or not max_seconds > 0:
            raise ValueError(f"max_seconds must be a positive number, got {max_seconds!r}")
        self.source = source
        self.max_steps, self.max_seconds = max_steps, float(max_seconds)
        env = _environment()
        import jinja2

        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {_describe(exc)}") from exc
        except (RecursionError, MemoryError) as exc:
            raise TemplateBoundError(f"the chat template does not compile: it is nested too deeply "
                                     f"({type(exc).__name__})") from exc

    def render(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = False, **variables) -> str:
        """The conversation as the model's prompt text.

        Args:
            messages: dicts with ``"role"`` and ``"content"`` (plain JSON values only).
            add_generation_prompt: end with the header of an assistant turn, so that the
                model writes the answer.
            **variables: other template variables (``bos_token``, ``eos_token``, ``tools``…).

        Raises:
            ChatTemplateError: the template fails (its ``raise_exception``, an undefined
                value, a type error), or tries to reach something the sandbox forbids: one
                message that says which.
            TemplateBoundError: the render goes past its steps, seconds or text.
            TypeError: ``messages`` is not a list of dicts, or holds values nested more than
                64 deep.
        """
        import jinja2

        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
            raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        data = {k: _plain(v) for k, v in variables.items()}
        chats = _plain(list(messages))
        budget = _Budget(self.max_steps, MAX_TEXT_BYTES + TEXT_PER_INPUT * (_text_size(chats) + _text_size(data)),
                         self.max_seconds)
        token = _BUDGET.set(budget)
        try:
            return self._template.render(messages=chats, add_generation_prompt=bool(add_generation_prompt), **data)
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as exc:
            raise ChatTemplateError(f"the chat template tried something the sandbox forbids: {exc}") from exc
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {_describe(exc)}") from exc
        except MemoryError as exc:
            raise TemplateBoundError("the chat template ran out of memory") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError,
                RecursionError) as exc:
            raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc
        finally:
            _BUDGET.reset(token)


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


def _plain(value, depth: int = 0):
    """``value`` rebuilt from plain JSON types (str, int, float, bool, None, dict, list);
    anything else becomes a placeholder naming its type, so that no object with methods
    reaches the template."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if depth > _MAX_DEPTH:
        raise TypeError(f"the values given to a chat template may be nested at most {_MAX_DEPTH} deep")
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, depth + 1): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, depth + 1) for v in value]
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:  # a NumPy scalar
        return _plain(value.item(), depth)
    return f"<{type(value).__name__}>"


def _text_size(value) -> int:
    """The characters of the strings inside a :func:`_plain` value."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_size(k) + _text_size(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_text_size(v) for v in value)
    return 0


# ---- the bounds of one render ------------------------------------------------------------------
class _Budget:
    """What one render may still spend: steps, characters of text made, time."""

    __slots__ = ("deadline", "max_steps", "max_text", "seconds", "steps", "text")

    def __init__(self, steps: int, text: int, seconds: float):
        self.steps, self.max_steps = steps, steps
        self.text, self.max_text = text, text
        self.seconds = seconds
        self.deadline = time.perf_counter() + seconds

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise TemplateBoundError(f"the chat template took more than {self.max_steps:,} steps (loop iterations "
                                     "and calls)")
        if time.perf_counter() > self.deadline:
            raise TemplateBoundError(f"the chat template ran longer than {self.seconds:g} s")

    def room(self, size: int, what: str) -> None:
        """Refuse, before it is made, a result of ``size`` characters past what is left."""
        if size > self.text:
            raise TemplateBoundError(f"the chat template would make {what} of {size:,} characters; it may make "
                                     f"{self.max_text:,} in all")

    def made(self, value):
        if isinstance(value, str | list | tuple | dict):
            self.text -= len(value)
            if self.text < 0:
                raise TemplateBoundError(f"the chat template made more than {self.max_text:,} characters of text")
        return value


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("attnlab_chat_budget", default=None)


class _NotWhileCompiling(Exception):
    """Raised by a bounded operation outside a render: jinja2 then leaves it to run time
    instead of folding it into a constant while the template compiles."""


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:
        raise _NotWhileCompiling
    return budget


# printf-style fields ("%-*.3f") and str.format fields ("{0:>12}"): their widths and precisions
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_FIELD = re.compile(r"\{[^{}]*\}")


def _check_format(fmt, budget: _Budget) -> None:
    """A format string whose fields ask for more characters than the budget holds (or for a
    width given as an argument, ``*``) is refused before it is formatted."""
    if not isinstance(fmt, str):
        return
    widths = [w for m in _PERCENT_FIELD.finditer(fmt) for w in m.groups() if w]
    widths += re.findall(r"\d+|\{", "".join(f.partition(":")[2] for f in _BRACE_FIELD.findall(fmt)))
    for w in widths:
        if not w.isdigit() or len(w) > 18 or int(w) > budget.text:
            budget.room(budget.text + 1 if not w.isdigit() or len(w) > 18 else int(w), "a formatted field")


def _check_call(name: str, value, args, kwargs, budget: _Budget) -> None:
    """Refuse, before it runs, a string method or filter ``name`` on ``value`` whose result
    could pass the budget: an integer argument larger than what is left (a width, a count),
    or a join, replacement or indentation that multiplies one text by another."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > budget.text:
            raise TemplateBoundError(f"the chat template calls {name}() with {a}, more than the {budget.max_text:,} "
                                     "characters it may make")
    text = value if isinstance(value, str) else None
    if name in ("format", "format_map"):
        _check_format(value, budget)
    elif name == "replace" and text is not None and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        count = text.count(old) if old else len(text) + 1
        budget.room(len(text) + count * max(len(new) - len(old), 0), "a replacement")
    elif name in ("indent", "wordwrap") and text is not None:
        pad = max((len(str(a)) for a in (*args, *kwargs.values()) if isinstance(a, str)), default=0)
        budget.room(len(text) + (text.count("\n") + 1) * pad, f"{name}()")
    elif name == "expandtabs" and text is not None:
        size = args[0] if args and isinstance(args[0], int) else kwargs.get("tabsize", 8)
        budget.room(len(text) + text.count("\t") * max(int(size), 0), "expandtabs()")


def _check_join(sep, items, budget: _Budget) -> None:
    """Refuse a join whose separators alone pass the budget (``items`` of a known length)."""
    n = len(items) if hasattr(items, "__len__") else 0
    budget.room(max(n - 1, 0) * len(str(sep)), "a join")


def _bounded_filter(name: str, f):
    """A filter that takes a step, is checked before it runs and counts what it makes."""
    import functools

    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # the context or environment first

    @functools.wraps(f)
    def run(*args, **kwargs):
        budget = _budget()
        budget.step()
        value, rest = (args[skip], args[skip + 1:]) if len(args) > skip else (None, ())
        _check_call(name, value, rest, kwargs, budget)
        if name == "join":
            _check_join(rest[0] if rest else kwargs.get("d", ""), value, budget)
        return budget.made(f(*args, **kwargs))

    return run


def _count_steps(iterable):
    """A loop's iterable, each item a step."""
    budget = _budget()
    for item in iterable:
        budget.step()
        yield item


def _count_text(value):
    """What a template writes or joins (``~``), counted against the budget."""
    budget = _budget()
    return budget.made(value if isinstance(value, str) else str(value))


_STEPS, _TEXT = "attnlab_steps", "attnlab_text"


def _bound_tree(tree) -> None:
    """Every loop's iterable counted, every written value and ``~`` join measured: the
    parsed template rewritten before it is compiled to Python."""
    from jinja2 import nodes

    def wrap(node, name):
        return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)

    for parent in list(tree.find_all(nodes.Node)):
        for field, value in parent.iter_fields():
            if isinstance(value, nodes.Concat):
                setattr(parent, field, wrap(value, _TEXT))
            elif isinstance(value, list) and any(isinstance(v, nodes.Concat) for v in value):
                setattr(parent, field, [wrap(v, _TEXT) if isinstance(v, nodes.Concat) else v for v in value])
    for loop in list(tree.find_all(nodes.For)):
        loop.iter = wrap(loop.iter, _STEPS)
    for out in list(tree.find_all(nodes.Output)):
        out.nodes = [n if isinstance(n, nodes.Filter) and n.name == _TEXT else
                     wrap(nodes.Const(n.data, lineno=n.lineno) if isinstance(n, nodes.TemplateData) else n, _TEXT)
                     for n in out.nodes]


_ENV = None


def _environment():
    """The one sandboxed environment (built once)."""
    global _ENV
    if _ENV is not None:
        return _ENV
    try:
        import jinja2
        import jinja2.ext
        from jinja2.compiler import CodeGenerator
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError("chat templates need jinja2: pip install 'attnlab[gguf]'") from None
    from datetime import datetime

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(str(message))

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        _check_format(str(fmt), _budget())
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

    class Bounded(CodeGenerator):
        """jinja2's compiler, given the template rewritten by :func:`_bound_tree`."""

        def visit_Template(self, node, frame=None):
            _bound_tree(node)
            return super().visit_Template(node, frame)

    class Sandbox(ImmutableSandboxedEnvironment):
        """jinja2's immutable sandbox, where reaching an unsafe attribute raises at once (the
        stock sandbox gives an undefined value, which may render as an empty string), every
        call is a step, and the operators that make large values are checked before they run
        (and never folded into constants while compiling)."""

        code_generator_class = Bounded
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def unsafe_undefined(self, obj, attribute):
            raise jinja2.exceptions.SecurityError(
                f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

        def call_binop(self, context, operator, left, right):
            budget = _budget()
            budget.step()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, str | list | tuple) and isinstance(n, int):
                        budget.room(len(seq) * max(n, 0), "a repeated text or list")
                if isinstance(left, int) and isinstance(right, int):
                    _check_bits(abs(left).bit_length() + abs(right).bit_length())
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
                _check_bits(right * max(abs(left).bit_length() - 1, 0))
            elif operator == "+" and isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
                budget.room(len(left) + len(right), "a joined text or list")
            elif operator == "%":
                _check_format(left, budget)
            return budget.made(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  (jinja2's signature)
            budget = _budget()
            budget.step()
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str | list):
                name = getattr(__obj, "__name__", "method")
                _check_call(name, owner, args, kwargs, budget)
                if name == "join" and isinstance(owner, str) and args:
                    _check_join(owner, args[0], budget)
            return budget.made(super().call(__context, __obj, *args, **kwargs))

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            fmt = value.__self__

            def checked(*args, **kwargs):
                _check_format(fmt, _budget())
                return wrapped(*args, **kwargs)

            return checked

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters[_STEPS] = _count_steps
    env.filters[_TEXT] = _count_text
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = SafeNamespace
    _ENV = env
    return env


def _check_bits(bits: int) -> None:
    if bits > _MAX_INT_BITS:
        raise TemplateBoundError(f"the chat template would make a number of about {math.ceil(bits * 0.30103):,} "
                                 f"digits; at most {math.floor(_MAX_INT_BITS * 0.30103):,} are made")
