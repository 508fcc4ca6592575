"""`stagelm serve`: an OpenAI-compatible HTTP server on the KV-cache engine.

    stagelm serve runs/sft/model [--host 127.0.0.1] [--port 8000] [--slots 16] [--queue 64]

Routes (Starlette on uvicorn):

- `GET /v1/models` (and `/v1/models/<name>`): the one model served, named by its directory as given;
- `POST /v1/chat/completions`: `messages` of user and assistant turns in stagelm's chat
  template, answered as the assistant;
- `POST /v1/completions`: a `prompt` string continued;
- both with `max_tokens`, `temperature`, `top_p`, `stop`, `seed`, `n` and `stream`
  (server-sent events, `data: [DONE]` last); temperature and top_p default to the model
  folder's generation_config.json (`modeldir.read_sampling_defaults`), else 1; OpenAI fields it does not implement are
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
cannot hold the descriptors); a head over 16 KiB or of another HTTP version than 1.x is refused
(`connection.check_head`); stop strings are bounded and matched only on new text;
`--slots` that the memory cannot hold (or past MAX_SLOTS) are refused at start; a chat
template renders on a thread of its own under its budgets, taking turns with the others
(`Server.prepare`), and a stopping server ends every rendering at once.
"""

import asyncio
import contextlib
import json
import signal
import threading
import time
import uuid
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from stagelm.data.template_sandbox import CLOCK, STOPPING, ChatRenderError, Turns
from stagelm.infer.connection import LOOPBACK_NAMES, MAX_HEAD, HostCheck, deadline_protocol, is_loopback, listen
from stagelm.infer.engine import Engine, Request
from stagelm.infer.generate import load_generator
from stagelm.infer.openai_api import (
    BadRequest,
    ChoiceText,
    Gone,
    chat_prompt,
    completion_prompt,
    error_body,
    settings,
    usage_of,
)
from stagelm.infra.errors import StagelmError
from stagelm.infra.memory import require_memory
from stagelm.model.footprint import kv_cache_bytes
from stagelm.model.modeldir import read_sampling_defaults

MAX_SLOTS = 1024  # requests decoded together: each batch size up to it compiles at start
MAX_QUEUE = 1 << 16  # requests waiting for a slot
MAX_BODY = 1 << 20  # bytes of a request body
BODY_DEADLINE = 30.0  # seconds a client may take to send its body once the head is in


def inline_json(value: Any) -> str:
    """`value` as JSON safe inside the page's <script>: `<`, `>` and `&` escaped, so a name
    holding `</script>` cannot close the script and run its own."""
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def require_renderable(chat: Any, model_dir: Path) -> None:
    """Refuse, before compiling, a chat template that cannot render one user turn (as import-hf and
    import-gguf refuse it): every chat request would fail."""
    if chat.template is None:
        return
    try:
        chat.render([{"role": "user", "content": "Hi."}], add_generation_prompt=True)
    except ChatRenderError as err:
        raise StagelmError(
            f"{model_dir / 'chat.json'}: its chat template cannot render one user turn ({err.reason}); "
            "fix or replace it (or import the checkpoint again)"
        ) from None


class Server:
    def __init__(self, model_dir: Path, name: str, slots: int, queue: int, hosts: tuple[str, ...] = ()):
        self.gen = load_generator(model_dir)
        require_renderable(self.gen.chat, model_dir)
        self.sampling = read_sampling_defaults(model_dir)  # its generation_config.json's, for requests giving none
        cfg = self.gen.model.cfg
        cache = kv_cache_bytes(cfg, slots, self.gen.capacity)
        logits = 4 * slots * cfg.vocab_size * 3  # the engine's logits and a step's copies of them
        require_memory(cache + logits, "--slots", f"{slots} slots × {self.gen.capacity} positions of KV cache")
        self.tokenizer = self.gen.tokenizer
        self.name = name
        self.hosts = hosts  # Host names answered; () = any
        self.engine = Engine(self.gen, slots, queue)
        self.created = int(time.time())
        self.turns = Turns()  # the chat templates' renderings take turns (template_sandbox)
        self.preparing, self.preparing_lock = 0, threading.Lock()  # requests whose prompt is being prepared

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

    async def prepare(self, ids: Callable[[dict, Any], list[int]], body: dict) -> list[int]:
        """`ids(body, chat format)`, the prompt's ids, on a thread of its own: a template is code from
        elsewhere, rendered off the event loop under its budgets and taking turns with the other
        renderings (`template_sandbox.Turns`), so templates that loop hold an ordinary request up
        for a slice each. At most slots + queue requests are prepared at once (429 beyond, as the
        engine refuses), and the threads are never waited for: a stopping server ends their renderings."""
        with self.preparing_lock:
            if self.preparing >= self.engine.slots + self.engine.queue_limit:
                raise BadRequest(
                    "the server is at capacity (every slot busy and the queue full); retry later",
                    status=429,
                    code="rate_limit_exceeded",
                )
            self.preparing += 1
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if not done.done():
                done.set_exception(error) if error is not None else done.set_result(result)

        def work() -> None:
            CLOCK.turns = self.turns
            result, error = None, None
            try:
                result = ids(body, self.gen.chat)
            except BaseException as err:  # handed to the request's handler, which answers it
                error = err
            finally:
                with self.preparing_lock:
                    self.preparing -= 1
            with contextlib.suppress(RuntimeError):  # the event loop has closed (the server stopped)
                loop.call_soon_threadsafe(settle, result, error)

        try:
            threading.Thread(target=work, name="stagelm-prompt", daemon=True).start()
        except RuntimeError:  # the system gives the process no more threads
            with self.preparing_lock:
                self.preparing -= 1
            raise BadRequest("the server cannot start another thread now; retry later", status=503) from None
        try:
            return await done
        except BadRequest:
            if self.turns.closed:
                raise BadRequest(STOPPING, status=503) from None
            raise

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
            prompt = await self.prepare(chat_prompt if chat else completion_prompt, body)
            default_max = self.engine.capacity if chat else 16
            opts = settings(body, self.engine.slots, default_max, self.sampling)
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
    defaults = ", ".join(f"{k} {v:g}" for k, v in server.sampling.items())
    defaults = f"; sampling defaults from its generation_config.json: {defaults}" if defaults else ""
    print(
        f"serve: {model_dir} as {server.name!r} on http://{shown}:{port} ({slots} slots, queue {queue}){defaults}",
        flush=True,
    )

    class Stopping(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            server.turns.close()  # renderings end at once: shutdown waits on no template
            super().handle_exit(sig, frame)

    http = deadline_protocol(header_timeout)
    config = uvicorn.Config(server.app(), log_level="warning", http=http, h11_max_incomplete_event_size=MAX_HEAD)
    Stopping(config).run(sockets=[sock])
