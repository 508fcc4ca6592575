"""`stagelm serve`: an OpenAI-compatible HTTP server on the KV-cache engine.

    stagelm serve runs/sft/model [--host 127.0.0.1] [--port 8000] [--slots 16] [--queue 64]

Routes (Starlette on uvicorn):

- `GET /v1/models` (and `/v1/models/<name>`): the one model served, named by its directory as given;
- `POST /v1/chat/completions`: `messages` of user and assistant turns in stagelm's chat
  template, answered as the assistant;
- `POST /v1/completions`: a `prompt` string continued;
- both with `max_tokens`, `temperature`, `top_p`, `stop`, `seed`, `n` and `stream`
  (server-sent events, `data: [DONE]` last); OpenAI fields it does not implement are
  refused (400) only where their value would change the answer (`logprobs`, `echo`,
  `best_of` > n), accepted where neutral; other unknown fields are ignored;
- `GET /v1/stats`: the engine's counters (requests, refusals, decode steps by batch size);
- `GET /`: a chat page (plain HTML and JS from this package, nothing from a CDN).

Requests decode together on `stagelm.infer.engine.Engine` (continuous batching over `--slots`
rows; at most `--queue` requests wait, beyond that 429 at once). Bad input gets an
OpenAI-style error object (`{"error": {"message", "type", "param", "code"}}`) and a
4xx, and the server keeps serving. A client that goes away frees its slots, streaming
or not.

Safe to leave running on a laptop: bound to loopback it answers only loopback Host
names (`--allow-host` adds one), so a web page cannot reach it by DNS rebinding; a POST
must say `Content-Type: application/json`, which a page on another origin cannot send
without the browser asking first (CSRF); a connection must send its request head
within `--header-timeout` seconds and its body within BODY_DEADLINE (slow clients
cannot hold the descriptors); stop strings are bounded and matched only on new text;
`--slots` that the memory cannot hold are refused at start.
"""

import asyncio
import json
import signal
import time
import uuid
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from stagelm.data.chatformat import ChatFormat
from stagelm.infer.connection import LOOPBACK_NAMES, HostCheck, deadline_protocol, is_loopback, listen
from stagelm.infer.engine import Engine, Request
from stagelm.infer.generate import load_generator
from stagelm.infra.errors import StagelmError
from stagelm.infra.memory import require_memory
from stagelm.model.footprint import kv_cache_bytes

MAX_BODY = 1 << 20  # bytes of a request body
MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_STOP_CHARS = 256  # characters of one stop string: matching costs grow with it
BODY_DEADLINE = 30.0  # seconds a client may take to send its body once the head is in


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


# --- request fields ---------------------------------------------------------------------


def field(body: dict, name: str, kinds: tuple, default: Any = None) -> Any:
    """`body[name]` if it has one of `kinds` (bool never counts as a number), else `default` when absent."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise BadRequest(f"{name}: expected {names}, got {json.dumps(value)[:60]}", name)
    return value


def settings(body: dict, slots: int, default_max: int) -> dict[str, Any]:
    """The sampling fields of a request, type- and range-checked."""
    max_tokens = field(body, "max_tokens", (int,), None)
    if max_tokens is None:
        max_tokens = field(body, "max_completion_tokens", (int,), default_max)
    if max_tokens < 1:
        raise BadRequest(f"max_tokens: expected a positive integer, got {max_tokens}", "max_tokens")
    temperature = float(field(body, "temperature", (int, float), 1.0))
    if not 0 <= temperature <= 2:
        raise BadRequest(f"temperature: expected a number in [0, 2], got {temperature}", "temperature")
    top_p = float(field(body, "top_p", (int, float), 1.0))
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p: expected a number in (0, 1], got {top_p}", "top_p")
    n = field(body, "n", (int,), 1)
    if not 1 <= n <= slots:
        raise BadRequest(f"n: expected an integer in [1, {slots}], got {n}", "n")
    seed = field(body, "seed", (int,), None)
    if seed is not None and not 0 <= seed < 2**31:
        raise BadRequest(f"seed: expected an integer in [0, {2**31 - 1}], got {seed}", "seed")
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
        raise BadRequest(f"stream_options: expected an object, got {json.dumps(options)[:60]}", "stream_options")
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
    except StagelmError as err:  # a role the format lacks, or a template that refused or ran past its bounds
        raise BadRequest(str(err), "messages") from None


def completion_prompt(body: dict, chat: ChatFormat) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt: expected a non-empty string", "prompt")
    return chat.text(text(prompt, "prompt"))


# --- one choice's text --------------------------------------------------------------------


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


# --- the app ------------------------------------------------------------------------------


def inline_json(value: Any) -> str:
    """`value` as JSON safe inside the page's <script>: `<`, `>` and `&` escaped, so a name
    holding `</script>` cannot close the script and run its own."""
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


class Server:
    def __init__(self, model_dir: Path, name: str, slots: int, queue: int, hosts: tuple[str, ...] = ()):
        self.gen = load_generator(model_dir)
        cfg = self.gen.model.cfg
        cache = kv_cache_bytes(cfg, slots, self.gen.capacity)
        logits = 4 * slots * cfg.vocab_size * 3  # the engine's logits and a step's copies of them
        require_memory(cache + logits, "--slots", f"{slots} slots × {self.gen.capacity} positions of KV cache")
        self.tokenizer = self.gen.tokenizer
        self.name = name
        self.hosts = hosts  # Host names answered; () = any
        self.engine = Engine(self.gen, slots, queue)
        self.created = int(time.time())

    def warm_up(self) -> None:
        """Compile the engine's decode step for every batch size, greedy and sampled, before the first request."""
        done = []

        def emit(choice: int, token: int | None, finish: str | None) -> None:
            if finish:
                done.append(finish)

        prompt = self.tokenizer.encode("Hello", add_special_tokens=False).ids or [0]
        for size in self.engine.sizes:
            for temperature in (0.0, 1.0):  # greedy batches and sampled ones compile apart
                done.clear()
                request = Request(prompt, 2, temperature, 1.0, 0, size, False, emit)
                self.engine.submit(request, force=True)
                while len(done) < size:
                    time.sleep(0.01)
        with self.engine.lock:  # the warm-up is not traffic
            self.engine.counters.update(requests=0, tokens=0)
            self.engine.counters["steps_by_batch"].clear()

    async def body(self, request: Any) -> dict:
        from starlette.requests import ClientDisconnect

        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":  # a form post from a web page cannot set it (CSRF)
            raise BadRequest(f"Content-Type: expected application/json, got {kind or 'none'!r}", status=415)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY:
            raise BadRequest(f"request body of {int(length):,} bytes exceeds the limit of {MAX_BODY:,}", status=413)
        data = bytearray()
        try:
            async with asyncio.timeout(BODY_DEADLINE):
                async for chunk in request.stream():
                    data += chunk
                    if len(data) > MAX_BODY:
                        raise BadRequest(f"request body exceeds the limit of {MAX_BODY:,} bytes", status=413)
        except TimeoutError:
            raise BadRequest(f"request body not received within {BODY_DEADLINE:.0f} s", status=408) from None
        except ClientDisconnect:
            raise Gone() from None
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None
        except RecursionError:
            raise BadRequest("the request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str):
            raise BadRequest("model: expected the model's name (GET /v1/models lists it)", "model")
        if model != self.name:
            raise BadRequest(
                f"model: {model!r} is not served here; this server serves {self.name!r}",
                "model",
                404,
                "model_not_found",
            )
        return body

    def start(self, prompt: list[int], opts: dict, chat: bool) -> tuple[Request, asyncio.Queue]:
        """Submit a request to the engine; its events arrive on the returned queue."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(choice: int, token: int | None, finish: str | None) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, (choice, token, finish))
            except RuntimeError:  # the event loop has closed (the server is stopping)
                request.cancel()

        request = Request(
            prompt, opts["max_tokens"], opts["temperature"], opts["top_p"], opts["seed"], opts["n"], chat, emit
        )
        try:
            accepted = self.engine.submit(request)
        except StagelmError as err:
            raise BadRequest(str(err), "messages" if chat else "prompt", code="context_length_exceeded") from None
        if not accepted:
            raise BadRequest(
                "the server is at capacity (every slot busy and the queue full); retry later",
                status=429,
                code="rate_limit_exceeded",
            )
        return request, events

    async def complete(self, http: Any, chat: bool) -> Any:
        from starlette.responses import JSONResponse, Response, StreamingResponse

        try:
            body = await self.body(http)
            prompt = chat_prompt(body, self.gen.chat) if chat else completion_prompt(body, self.gen.chat)
            default_max = self.engine.capacity if chat else 16
            opts = settings(body, self.engine.slots, default_max)
            if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
                opts["max_tokens"] = max(1, min(default_max, self.engine.capacity - len(prompt)))
            request, events = self.start(prompt, opts, chat)
        except BadRequest as err:
            return JSONResponse(error_body(err), status_code=err.status)
        except Gone:
            return Response(status_code=400)  # never sent: the connection is closed
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        texts = [ChoiceText(self.tokenizer, opts["stop"]) for _ in range(opts["n"])]
        meta = {"id": ident, "created": int(time.time()), "model": self.name}
        if opts["stream"]:
            usage = (lambda: usage_of(prompt, texts)) if opts["include_usage"] else None
            chunks = self.stream(request, events, texts, meta, chat, usage)
            return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        watch = asyncio.create_task(self.watch(http, request, events))
        try:
            finishes = await self.collect(request, events, texts)
        finally:
            watch.cancel()
        if finishes is None:
            return Response(status_code=499)  # the client went away; nothing is sent
        if "error" in finishes:  # the engine failed on this batch (its traceback is in the server's log)
            err = BadRequest("the engine failed while decoding this request; see the server's log", status=500)
            return JSONResponse(error_body(err), status_code=500)
        choices = []
        for i, (text, finish) in enumerate(zip(texts, finishes, strict=True)):
            whole = text.whole()
            if chat:
                message = {"role": "assistant", "content": whole}
                choices.append({"index": i, "message": message, "finish_reason": finish, "logprobs": None})
            else:
                choices.append({"index": i, "text": whole, "finish_reason": finish, "logprobs": None})
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse({**meta, "object": obj, "choices": choices, "usage": usage_of(prompt, texts)})

    @staticmethod
    async def watch(http: Any, request: Request, events: asyncio.Queue) -> None:
        """Cancel `request` when its client disconnects (the body is read: the next message is that)."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        request.cancel()
        events.put_nowait((None, None, "gone"))

    async def collect(self, request: Request, events: asyncio.Queue, texts: list[ChoiceText]) -> list[str] | None:
        """Wait for every choice to finish; the finish reasons, in OpenAI's words (None: the client went away)."""
        finishes: list[str | None] = [None] * len(texts)
        try:
            while any(f is None for f in finishes):
                choice, token, finish = await events.get()
                if choice is None:  # the client disconnected
                    return None
                if finishes[choice] is not None:
                    continue
                if token is not None:
                    texts[choice].add(token)
                    if texts[choice].stopped:  # a stop string: this choice ends here
                        finishes[choice] = "stop"
                        request.stop_choice(choice)
                else:
                    finishes[choice] = "stop" if finish in ("stop", "cancelled") else finish
        finally:
            if any(f is None for f in finishes):  # the handler was cancelled: free the slots
                request.cancel()
        return [str(f) for f in finishes]

    async def stream(
        self,
        request: Request,
        events: asyncio.Queue,
        texts: list[ChoiceText],
        meta: dict,
        chat: bool,
        usage: Callable[[], dict] | None = None,
    ):
        """Server-sent events: a chunk per released piece of text, a last chunk per choice, then
        [DONE]. With `usage` (stream_options.include_usage) every chunk says `"usage": null` and
        one more chunk, with no choices, carries the usage of every choice before [DONE]."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        extra = {"usage": None} if usage else {}

        def chunk(index: int, piece: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": piece} if piece else {})
                choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": index, "text": piece or "", "finish_reason": finish, "logprobs": None}
            return f"data: {json.dumps({**meta, 'object': obj, 'choices': [choice], **extra})}\n\n"

        finishes: list[str | None] = [None] * len(texts)
        try:
            if chat:
                for i in range(len(texts)):
                    yield chunk(i, None, None, first=True)
            while any(f is None for f in finishes):
                choice, token, finish = await events.get()
                if finishes[choice] is not None:
                    continue
                if token is not None:
                    piece = texts[choice].add(token)
                    if piece:
                        yield chunk(choice, piece, None)
                    if texts[choice].stopped:
                        finishes[choice] = "stop"
                        request.stop_choice(choice)
                        yield chunk(choice, None, "stop")
                    continue
                rest = texts[choice].finish()
                if rest:
                    yield chunk(choice, rest, None)
                finishes[choice] = "stop" if finish in ("stop", "cancelled") else finish
                yield chunk(choice, None, finishes[choice])
            if usage:
                yield f"data: {json.dumps({**meta, 'object': obj, 'choices': [], 'usage': usage()})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if any(f is None for f in finishes):  # the client closed the connection: free the slots
                request.cancel()

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request as HttpRequest
        from starlette.responses import HTMLResponse, JSONResponse
        from starlette.routing import Route

        page = resources.files("stagelm.infer").joinpath("chat.html").read_text()

        entry = {"id": self.name, "object": "model", "created": self.created, "owned_by": "stagelm"}

        async def models(_: HttpRequest) -> JSONResponse:
            return JSONResponse({"object": "list", "data": [entry]})

        async def model(http: HttpRequest) -> JSONResponse:
            if http.path_params["name"] == self.name:
                return JSONResponse(entry)
            err = BadRequest(f"model: {http.path_params['name']!r} is not served here", "model", 404, "model_not_found")
            return JSONResponse(error_body(err), status_code=404)

        async def chat(http: HttpRequest) -> Any:
            return await self.complete(http, chat=True)

        async def completions(http: HttpRequest) -> Any:
            return await self.complete(http, chat=False)

        async def stats(_: HttpRequest) -> JSONResponse:
            return JSONResponse(self.engine.snapshot())

        inline = inline_json(self.name)

        async def index(_: HttpRequest) -> HTMLResponse:
            return HTMLResponse(page.replace("{{MODEL}}", inline))

        async def not_found(http: HttpRequest, exc: Exception) -> JSONResponse:
            status = getattr(exc, "status_code", 404)
            err = BadRequest(f"{http.method} {http.url.path}: no such route", status=status)
            return JSONResponse(error_body(err), status_code=status)

        routes = [
            Route("/", index),
            Route("/v1/models", models),
            Route("/v1/models/{name:path}", model),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/stats", stats),
        ]
        app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
        return HostCheck(app, self.hosts) if self.hosts else app


def serve(
    model_dir: Path,
    host: str,
    port: int,
    slots: int,
    queue: int,
    name: str | None = None,
    allow_hosts: tuple[str, ...] = (),
    header_timeout: float = 10.0,
) -> None:
    """Load the model, compile, and serve until interrupted."""
    try:
        import uvicorn
    except ImportError:
        raise StagelmError("serve: needs the serve extra; pip install -e '.[serve]'") from None
    sock = listen(host, port)  # a taken port fails here, in one line, before the model loads
    port = sock.getsockname()[1]
    hosts = (*LOOPBACK_NAMES, *allow_hosts) if is_loopback(host) else allow_hosts
    server = Server(model_dir, name or str(model_dir), slots, queue, hosts)
    print(f"serve: {model_dir} loaded; compiling for 1 to {slots} requests at once before serving", flush=True)
    server.warm_up()
    # uvicorn shuts down gracefully on SIGINT/SIGTERM and then raises the signal again: let it
    # end the process as usual (the stages' handler would print advice about checkpoints).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    shown = f"[{host}]" if ":" in host else host
    print(f"serve: {model_dir} as {server.name!r} on http://{shown}:{port} ({slots} slots, queue {queue})", flush=True)
    config = uvicorn.Config(server.app(), log_level="warning", http=deadline_protocol(header_timeout))
    uvicorn.Server(config).run(sockets=[sock])
