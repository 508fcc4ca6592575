"""The sandbox a checkpoint's chat template renders in: transformers' (an immutable sandboxed
Jinja environment with `trim_blocks`, `lstrip_blocks`, loop controls, `tojson`,
`raise_exception` and `strftime_now`), with budgets, since a template is code from elsewhere:

- time: `MAX_RENDER_SECONDS` per rendering, checked at every loop iteration, call, attribute
  and item against this thread's deadline (`CLOCK`, set by the renderer; per thread, so a
  server renders off its event loop, several at once, taking turns (`Turns`) so that
  templates that loop hold an ordinary rendering up for a slice each, not for their budget);
- size: `MAX_RENDER_CHARS` of any string or list the template builds (`~`, `+`, `*`,
  `replace`), sized before it is built, and of every filter's and method's result;
- arithmetic: integers of at most `MAX_INT_BITS`, and `*`, `**`, `+` and `%` are never folded
  at compile time (where no deadline could stop them);
- arguments: a builtin's count, width or indent of at most `MAX_RENDER_CHARS` (tojson's indent
  at most 64), and no format field wider than six digits.
"""

import collections
import contextlib
import functools
import json
import re
import threading
import time
import types
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from stagelm.infra.errors import StagelmError

MAX_RENDER_SECONDS = 2.0
MAX_RENDER_CHARS = 4 << 20
MAX_INT_BITS = 1 << 16


class ChatRenderError(StagelmError):
    """A rendering the template refused (raise_exception), or one past its budgets; `reason` is the
    message without the file (what a server tells its clients)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


class Clock(threading.local):
    """This thread's rendering deadline (the renderer sets and clears it), and the turns it takes with
    other threads' renderings (a server sets them on the threads that render for it)."""

    deadline = float("inf")  # monotonic time past which this thread's rendering stops
    turns: "Turns | None" = None
    ticket: threading.Event | None = None  # this thread's place in the turns' line, while it renders
    slice_end = float("inf")  # when it passes the turn on to the next in line


CLOCK = Clock()
RENDER_SLICE = 0.005  # seconds a rendering runs before it lets the next one waiting run


class Turns:
    """Renderings that take turns, first come first served, each for RENDER_SLICE at a time (every
    budget check may pass the turn on): many templates looping at once then cost a server one
    thread's worth of CPU, and an ordinary rendering beside them waits one slice for each, not
    for each to spend its whole time budget. `close` ends every rendering at its next check."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.line: collections.deque[threading.Event] = collections.deque()  # its head runs
        self.closed = False

    def take(self) -> None:
        """Wait for this thread's turn."""
        ticket = threading.Event()
        with self.lock:
            if self.closed:
                raise ChatRenderError(STOPPING)
            self.line.append(ticket)
            if len(self.line) == 1:
                ticket.set()
        CLOCK.ticket = ticket
        ticket.wait()
        if self.closed:
            self.give()
            raise ChatRenderError(STOPPING)
        CLOCK.slice_end = time.monotonic() + RENDER_SLICE

    def give(self) -> None:
        """Leave the line (at its head: the next one's turn begins)."""
        ticket, CLOCK.ticket, CLOCK.slice_end = CLOCK.ticket, None, float("inf")
        with self.lock:
            if ticket in self.line:
                first = self.line[0] is ticket
                self.line.remove(ticket)
                if first and self.line:
                    self.line[0].set()

    def pass_turn(self) -> None:
        """At a budget check: once this slice is spent, let the next one waiting run first."""
        if self.closed:
            raise ChatRenderError(STOPPING)
        if time.monotonic() > CLOCK.slice_end and len(self.line) > 1:
            self.give()
            self.take()

    def close(self) -> None:
        """End every rendering, running or waiting, at its next check (the server is stopping)."""
        with self.lock:
            self.closed = True
            for ticket in self.line:
                ticket.set()


STOPPING = "the server is stopping; send the request again once it is back"


@contextlib.contextmanager
def taking_turns() -> Iterator[None]:
    """Render in this thread's turn when it takes turns (CLOCK.turns), at once otherwise."""
    turns = CLOCK.turns
    if turns is None:
        yield
        return
    turns.take()
    try:
        yield
    finally:
        turns.give()


_HUGE_FIELD = re.compile(r"\d{7,}|\*")  # a width or precision that builds megabytes, or one read from the arguments


def _bounded_count(count: int, what: str) -> None:
    if count > MAX_RENDER_CHARS:
        raise ChatRenderError(f"the chat template's {what} exceeds {MAX_RENDER_CHARS:,} items; refused")


def _bounded_size(value: Any, what: str) -> Any:
    if isinstance(value, str | bytes | list | tuple | dict):
        _bounded_count(len(value), what)
    return value


def _check_arguments(args: Sequence[Any], kwargs: dict[str, Any], what: str) -> None:
    """Refuse a number that would make a builtin build something huge (a width, a count, an indent)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and abs(value) > MAX_RENDER_CHARS:
            raise ChatRenderError(
                f"the chat template passes {str(value)[:20]}… to {what}; at most {MAX_RENDER_CHARS:,}"
            )


def _check_format(text: Any, what: str) -> None:
    if isinstance(text, str) and ("%" in text or "{" in text):
        for spec in re.findall(r"%[^a-zA-Z%]*|\{[^{}]*\}", text):
            if _HUGE_FIELD.search(spec):
                raise ChatRenderError(f"the chat template's {what} asks for a field of {spec[:20]!r}; refused")


class Generation(Extension):
    """`{% generation %}…{% endgeneration %}`, which some templates use to mark assistant text for
    transformers' masks: rendered as its body (stagelm finds those tokens by prefixes)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class Budgeted(NodeTransformer):
    """Loops tick the clock at every iteration; `~` concatenation is sized before it is built."""

    def visit_For(self, node: Any) -> Any:
        node = self.generic_visit(node)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("ticking"), [node.iter], [], None, None)
        return node

    def visit_Concat(self, node: Any) -> Any:
        node = self.generic_visit(node)
        return nodes.Call(nodes.EnvironmentAttribute("concat"), node.nodes, [], None, None)


class Bounded(ImmutableSandboxedEnvironment):
    """transformers' sandbox with the budgets: every hook the sandbox has checks the clock and sizes."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    @staticmethod
    def check() -> None:
        if time.monotonic() > CLOCK.deadline:
            raise ChatRenderError(f"the chat template took more than {MAX_RENDER_SECONDS:g} s to render")
        if CLOCK.ticket is not None:
            CLOCK.turns.pass_turn()

    def _parse(self, source: str, name: Any, filename: Any) -> Any:
        return Budgeted().visit(super()._parse(source, name, filename))

    def ticking(self, iterable: Any) -> Any:
        for item in iterable:
            self.check()
            yield item

    def concat(self, *parts: Any) -> str:
        texts = [str(p) for p in parts]
        _bounded_count(sum(map(len, texts)), "text")
        return "".join(texts)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.check()
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and ints and abs(left) > 1 and right > 0:
            if abs(left).bit_length() * min(right, MAX_INT_BITS + 1) > MAX_INT_BITS:
                raise ChatRenderError(f"the chat template raises an integer past {MAX_INT_BITS} bits; refused")
        elif operator == "*" and ints:
            if abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
                raise ChatRenderError(f"the chat template multiplies integers past {MAX_INT_BITS} bits; refused")
        elif operator == "*" and (isinstance(left, int) or isinstance(right, int)):
            times, seq = (left, right) if isinstance(left, int) else (right, left)
            if hasattr(seq, "__len__"):
                _bounded_count(len(seq) * max(times, 0), "repetition")
        elif operator == "+" and hasattr(left, "__len__") and hasattr(right, "__len__"):
            _bounded_count(len(left) + len(right), "concatenation")
        elif operator == "%":
            _check_format(left, "% formatting")
        return _bounded_size(super().call_binop(context, operator, left, right), "value")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        __self.check()
        if isinstance(__obj, types.BuiltinMethodType):  # str.ljust, str.replace, list.index ...
            _check_arguments(args, kwargs, f"{getattr(__obj, '__name__', 'a method')}()")
            if getattr(__obj, "__name__", "") == "replace" and len(args) >= 2 and isinstance(__obj.__self__, str):
                grows = __obj.__self__.count(args[0]) if args[0] else len(__obj.__self__) + 1
                _bounded_count(len(__obj.__self__) + grows * len(args[1]), "replace()")
        return _bounded_size(super().call(__context, __obj, *args, **kwargs), "value")

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_format(value.__self__, "str.format")
        return wrapped

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.check()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.check()
        return super().getitem(obj, argument)


def bounded_filter(name: str, fn: Any) -> Any:
    """Filter `name` under the budgets: the clock, its arguments, and its result's size."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        Bounded.check()
        _check_arguments(args[1:], kwargs, f"the {name} filter")
        if name == "format":
            _check_format(next((a for a in args if isinstance(a, str)), None), "format filter")
        return _bounded_size(fn(*args, **kwargs), f"{name} filter's result")

    return run


def raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    if not (
        indent is None or isinstance(indent, int) and 0 <= indent <= 64 or isinstance(indent, str) and len(indent) <= 64
    ):
        raise ChatRenderError("the chat template's tojson indent is past 64; refused")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def sandbox() -> Bounded:
    """A new budgeted environment (a template compiles in it once and renders many times)."""
    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
