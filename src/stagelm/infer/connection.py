"""What `stagelm serve` accepts at the connection, before a request reaches the app.

- `listen`: the socket, bound before the model loads (a taken port fails in one line;
  port 0 takes a free one, and the server announces the one it got);
- `HostCheck`: bound to loopback, only loopback Host names are answered (plus any
  `--allow-host`): a web page that points its own DNS name at 127.0.0.1 (DNS rebinding)
  still sends its own name, and gets a 400;
- `deadline_protocol`: a connection must send its request head within a deadline, or
  it is closed: uvicorn has none (uvicorn#157), so clients trickling header bytes could
  hold every descriptor the process may open and lock everyone else out (slowloris);
  and near the descriptor limit the oldest connection still without its head is closed
  to make room for a new one; what h11 refuses in a request's head is answered with an
  OpenAI error object (`send_error_object`), as the app answers everything else, and so is
  a request of another HTTP version than 1.0 or 1.1, or with a head over MAX_HEAD (`check_head`).
"""

import asyncio
import errno
import http
import ipaddress
import json
import resource
import socket
from typing import Any

from stagelm.infra.errors import StagelmError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# Bytes of a request's line and headers: h11's own bound on a head still arriving (uvicorn's
# h11_max_incomplete_event_size), held to a head that arrives whole in one read too.
MAX_HEAD = 1 << 14
HTTP_VERSIONS = (b"1.0", b"1.1")  # h11 reads any `HTTP/d.d` in a request line, and answers in 1.1


def host_name(header: str) -> str:
    """The name of a Host header, without its port: `[::1]:8000` → `::1`, `localhost:80` → `localhost`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostCheck:
    """ASGI middleware answering only requests whose Host names one of `hosts` (400 otherwise):
    a page that rebinds its own DNS name to 127.0.0.1 still sends its own name."""

    def __init__(self, app: Any, hosts: tuple[str, ...]):
        self.app, self.hosts = app, {h.lower() for h in hosts}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            name = host_name(headers.get(b"host", b"").decode("latin-1"))
            if name not in self.hosts:
                from starlette.responses import JSONResponse

                message = f"Host: {name or 'missing'!r} is not a name of this server; see --allow-host"
                body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
                await JSONResponse(body, status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def connection_cap() -> int:
    """Connections the server holds at once: the descriptors it may open, less a reserve for
    its own files. Past the limit, accept() fails: asyncio then logs every try (thousands a
    second) and uvloop accepts and closes every waiting client, good ones too."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(8, min(soft, 1 << 16) - 64)


def check_head(request: Any) -> None:
    """Refuse, as h11 refuses a head it cannot parse, an `h11.Request` of an HTTP version other than
    1.0 and 1.1 (`HTTP/2.0` in a request line is no HTTP/2: h11 would answer it in 1.1 as if it
    were) or whose line and headers exceed MAX_HEAD (h11 bounds only a head still arriving)."""
    import h11

    if request.http_version not in HTTP_VERSIONS:
        version = request.http_version.decode("ascii", "replace")
        raise h11.RemoteProtocolError(f"HTTP/{version} is not served here; send HTTP/1.1", error_status_hint=400)
    size = len(request.method) + len(request.target) + sum(len(k) + len(v) + 4 for k, v in request.headers)
    if size > MAX_HEAD:
        raise h11.RemoteProtocolError(
            f"its head is {size:,} bytes, more than the {MAX_HEAD:,} this server reads; send fewer or shorter headers",
            error_status_hint=431,
        )


def keep_protocol_errors(protocol: Any) -> None:
    """Keep, as `protocol.protocol_error`, what h11 finds wrong with a request (and what `check_head`
    refuses, as h11 refuses it): uvicorn answers it without saying why."""
    import h11

    read = protocol.conn.next_event
    protocol.protocol_error = None

    def next_event() -> Any:
        try:
            event = read()
            if isinstance(event, h11.Request):
                check_head(event)
            return event
        except h11.RemoteProtocolError as err:
            protocol.protocol_error = err
            raise

    protocol.conn.next_event = next_event


def send_error_object(protocol: Any, msg: str) -> None:
    """Answer what h11 refuses (a Content-Length of -5 or of 24 digits, two Host headers, a malformed
    head) as an OpenAI error object, as the app answers everything else, not in uvicorn's plain text."""
    import h11

    err = protocol.protocol_error
    status = err.error_status_hint if err is not None and 400 <= err.error_status_hint < 500 else 400
    message = f"the request is not valid HTTP/1.1: {str(err)[:200]}" if err is not None else msg
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}})
    headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
    headers.append((b"content-length", str(len(body)).encode()))
    try:
        head = h11.Response(status_code=status, headers=headers, reason=http.HTTPStatus(status).phrase)
        for event in (head, h11.Data(data=body.encode())):
            protocol.transport.write(protocol.conn.send(event))
        protocol.transport.write(protocol.conn.send(h11.EndOfMessage()))
    except h11.LocalProtocolError:  # a response had already begun: nothing more can be said
        pass
    protocol.transport.close()


def deadline_protocol(header_timeout: float, cap: int | None = None) -> type:
    """uvicorn's h11 protocol, dropping a connection that has not sent a whole request head
    within `header_timeout` seconds of opening (or of its last response, when kept alive).
    uvicorn has no such timeout (uvicorn#157): a client trickling header bytes would keep
    its descriptor forever, and a few hundred of them lock every other client out. At `cap`
    open connections (`connection_cap`), a new one makes the oldest still without its head
    make room: so the descriptors never run out and a good client is answered at once."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    limit = cap or connection_cap()
    headless: dict[Any, None] = {}  # connections waiting for their head, oldest first

    class DeadlineProtocol(H11Protocol):
        head_timer: asyncio.TimerHandle | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            keep_protocol_errors(self)

        def send_400_response(self, msg: str) -> None:
            send_error_object(self, msg)

        def arm(self) -> None:
            self.disarm()
            self.head_timer = self.loop.call_later(header_timeout, self.drop)
            headless[self] = None

        def disarm(self) -> None:
            headless.pop(self, None)
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def drop(self) -> None:
            self.disarm()
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limit and headless:
                next(iter(headless)).drop()
            self.arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self.disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the head is in (or the connection failed)
                self.disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.arm()  # kept alive: the next request's head has the same deadline

    return DeadlineProtocol


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port` (port 0: one the system picks), or one line saying why not."""
    if not 0 <= port <= 65535:
        raise StagelmError(f"--port: expected 0 to 65535 (0 = any free port), got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as err:
        raise StagelmError(f"--host: {host!r} cannot be resolved ({err}); give an address such as 127.0.0.1") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)  # from here connections queue, while the model loads and compiles
    except OSError as err:
        sock.close()
        why = f"cannot listen on {host}:{port} ({err.strerror})"
        if err.errno == errno.EADDRNOTAVAIL:  # the address is none of this machine's
            raise StagelmError(f"--host {host}: {why}; give an address of this machine, such as 127.0.0.1") from None
        raise StagelmError(f"--port {port}: {why}; choose another port") from None
    return sock


def is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (socket.gaierror, ValueError, UnicodeError):
        return False
