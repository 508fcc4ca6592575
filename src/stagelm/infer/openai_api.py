"""The OpenAI API as `stagelm serve` reads and answers it: request fields, prompts, a choice's text.

A request's fields are type- and range-checked here, and a bad one is a `BadRequest`
answered as OpenAI's error object (`{"error": {"message", "type", "param", "code"}}`) with
a 4xx. Fields the server does not implement are refused only where their value would
change the answer (`logprobs`, `echo`, `best_of` > n), accepted where neutral. A choice's
text is released as tokens arrive, cut at the first stop string (`ChoiceText`).
"""

import json
from typing import Any

from stagelm.data.chatformat import ChatFormat, ChatRenderError
from stagelm.infra.errors import StagelmError

MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_STOP_CHARS = 256  # characters of one stop string: matching costs grow with it


class BadRequest(Exception):
    """A client error, answered as an OpenAI error object with `status`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code
        kinds = {429: "rate_limit_error"}
        self.kind = kinds.get(status, "server_error" if status >= 500 else "invalid_request_error")


class Gone(Exception):
    """The client went away before its request was read: nobody to answer."""


def error_body(err: BadRequest) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}}


def shown(value: Any, limit: int = 40) -> str:
    """A request's value as an error quotes it: JSON, cut at `limit` characters (a 400-digit number too)."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def field(body: dict, name: str, kinds: tuple, default: Any = None) -> Any:
    """`body[name]` if it has one of `kinds` (bool never counts as a number; an integer beyond
    what a float holds neither), else `default` when absent."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise BadRequest(f"{name}: expected {names}, got {shown(value)}", name)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_NUMBER:
        raise BadRequest(f"{name}: {shown(value)} is out of range", name)
    return value


MAX_NUMBER = 2**63  # no field of a request means anything beyond it; Python's float() of more overflows


def settings(body: dict, slots: int, default_max: int, defaults: dict[str, float] | None = None) -> dict[str, Any]:
    """The sampling fields of a request, type- and range-checked; `defaults` (the model's
    generation_config.json: temperature, top_p) stand where the request gives none, else OpenAI's 1."""
    defaults = defaults or {}
    given = {name: field(body, name, (int,), None) for name in ("max_tokens", "max_completion_tokens")}
    for name, value in given.items():  # both checked: max_tokens wins, but a bad one beside it is still bad
        if value is not None and value < 1:
            raise BadRequest(f"{name}: expected a positive integer, got {shown(value)}", name)
    max_tokens = next((v for v in given.values() if v is not None), default_max)
    temperature = float(field(body, "temperature", (int, float), defaults.get("temperature", 1.0)))
    if not 0 <= temperature <= 2:
        raise BadRequest(f"temperature: expected a number in [0, 2], got {temperature}", "temperature")
    top_p = float(field(body, "top_p", (int, float), defaults.get("top_p", 1.0)))
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p: expected a number in (0, 1], got {top_p}", "top_p")
    n = field(body, "n", (int,), 1)
    if not 1 <= n <= slots:
        raise BadRequest(f"n: expected an integer in [1, {slots}], got {shown(n)}", "n")
    seed = field(body, "seed", (int,), None)
    if seed is not None and not 0 <= seed < 2**31:
        raise BadRequest(f"seed: expected an integer in [0, {2**31 - 1}], got {shown(seed)}", "seed")
    stop = field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise BadRequest(
            f"stop: expected a string or a list of at most {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} characters",
            "stop",
        )
    for s in stop:
        text(s, "stop")
    stream = field(body, "stream", (bool,), False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest(f"stream_options: expected an object, got {shown(options)}", "stream_options")
    if options is not None and not stream:
        raise BadRequest("stream_options: only allowed with stream: true", "stream_options")
    include_usage = field(options or {}, "include_usage", (bool,), False)
    unsupported(body, n)
    return {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "n": n,
        "seed": seed,
        "stop": stop,
        "stream": stream,
        "include_usage": include_usage,
    }


def text(value: str, param: str) -> str:
    """`value` if it is text UTF-8 can carry (JSON's `\\ud800` escapes decode to lone surrogates, which it cannot)."""
    try:
        value.encode()
    except UnicodeEncodeError:
        raise BadRequest(f"{param}: holds a lone surrogate (\\ud800-\\udfff), not text", param) from None
    return value


def unsupported(body: dict, n: int) -> None:
    """Refuse the OpenAI fields this server does not implement where their value would change
    the answer; accept their neutral values, which clients send by default."""
    logprobs = body.get("logprobs")
    if logprobs not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise BadRequest("logprobs: not supported by this server; leave it out (or false)", "logprobs")
    if body.get("echo") not in (None, False):
        raise BadRequest("echo: not supported by this server; leave it out (or false)", "echo")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise BadRequest(f"best_of: only best_of = n ({n}) is supported; leave it out", "best_of")
    for name, kinds in TYPED.items():  # accepted and unused, but of the type OpenAI gives them
        field(body, name, kinds)
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadRequest(f"tools: expected a list of tool objects, got {shown(tools)}", "tools")
    for name, neutral in NEUTRAL.items():
        if body.get(name) not in neutral:
            raise BadRequest(f"{name}: {shown(body[name])} is not supported by this server; leave it out", name)
    if tools and body.get("tool_choice") in (None, "auto"):
        raise BadRequest("tools: tool calls are not supported by this server; leave tools out", "tools")


# OpenAI fields this server accepts and ignores (they change no answer), with their types: a value of
# another type is the client's mistake, refused as OpenAI refuses it.
TYPED: dict[str, tuple] = {
    "user": (str,),
    "metadata": (dict,),
    "store": (bool,),
    "parallel_tool_calls": (bool,),
    "service_tier": (str,),
}


# OpenAI fields this server does not implement, with the values that change nothing (what
# clients send by default); any other value would change the answer, so it is refused.
NEUTRAL: dict[str, tuple] = {
    "tool_choice": (None, "none", "auto"),  # "auto" with no tools is no tool call
    "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "suffix": (None, ""),
}


def chat_prompt(body: dict, chat: ChatFormat) -> list[int]:
    """The ids of a request's `messages`, rendered in the model's chat format, ready for its answer."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: expected a non-empty list of {role, content} objects", "messages")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}]: expected an object with role and content", "messages")
        role, content = message.get("role"), message.get("content")
        if isinstance(content, list):  # the content-parts form: text parts only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content: expected a string", "messages")
        turns.append({"role": role, "content": text(content, "messages")})
    if turns[-1]["role"] != "user":
        raise BadRequest("messages: the last message must be the user's", "messages")
    try:
        return chat.prompt(turns)
    except ChatRenderError as err:  # the template refused or ran past its budgets: the reason, not the server's path
        raise BadRequest(err.reason, "messages") from None
    except StagelmError as err:  # a role the format lacks, or a template that refused or ran past its bounds
        raise BadRequest(str(err), "messages") from None


def completion_prompt(body: dict, chat: ChatFormat) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt: expected a non-empty string", "prompt")
    return chat.text(text(prompt, "prompt"))


class ChoiceText:
    """The text of one choice as tokens arrive: decoded whole (multi-byte characters
    complete), cut at the first stop string, and released in pieces that can no
    longer turn out to be part of a stop string. A stop string can only begin in the
    text not yet released (what was released ends in no stop string's prefix), so each
    token searches that tail alone: the work per token does not grow with the text."""

    def __init__(self, tokenizer: Any, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already released
        self.stopped = False
        self.cut: int | None = None  # where the stop string began

    def add(self, token: int) -> str:
        """The new text safe to release after `token` ("" while it may still be a stop string)."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        if text.endswith("\ufffd"):  # half a character: wait for the rest
            return ""
        cut = min((i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.cut = cut
            return self.release(text[:cut])
        held = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self.release(text[: len(text) - held])

    def finish(self) -> str:
        """What was held back, at the end of the choice (unless a stop string cut it)."""
        if self.stopped:
            return ""
        return self.release(self.tokenizer.decode(self.ids, skip_special_tokens=False))

    def whole(self) -> str:
        """The choice's whole text, cut at the first stop string."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        return text[: self.cut] if self.cut is not None else text

    def release(self, text: str) -> str:
        piece = text[self.sent :]
        self.sent = max(self.sent, len(text))
        return piece


def usage_of(prompt: list[int], texts: list[ChoiceText]) -> dict[str, int]:
    """OpenAI's usage of a request: its prompt's tokens once, and the tokens of every choice."""
    completion = sum(len(t.ids) for t in texts)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}
