"""`stagelm serve` as clients see it: the official openai client, raw HTTP and a browser
against real server processes on free loopback ports."""

import http.client
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
from browser import CHROMIUM, NEEDS, Browser
from conftest import env_with_venv, run
from flax import nnx
from serve_process import NAME, Server
from tokenizers import Tokenizer

from stagelm.data.chatformat import MAX_RENDER_SECONDS, write_chat_spec
from stagelm.model.decoder import Decoder, DecoderConfig
from stagelm.model.modeldir import save_model

WHY = "the serve tests need the serve extra and the openai client: pip install -e '.[serve,serve-test]' (.ci/run does)"
openai = pytest.importorskip("openai", reason=WHY)
pytest.importorskip("starlette", reason=WHY)
pytest.importorskip("uvicorn", reason=WHY)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(pretrained, tmp_path_factory):
    """A server on the micro pretrained model (context 64, 16 slots)."""
    server = Server(pretrained, tmp_path_factory.mktemp("serve") / "trained.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def long_model(micro_data, tmp_path_factory) -> Path:
    """An untrained tiny model with a 2,048-token context: requests that run long enough
    to hold every slot while a test acts (greedy, it never emits <|eos|> on these prompts)."""
    tokenizer = micro_data / "tokenizer/tokenizer.json"
    vocab = Tokenizer.from_file(str(tokenizer)).get_vocab_size()
    cfg = DecoderConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
    out = tmp_path_factory.mktemp("long") / "model"
    save_model(out, Decoder(cfg, nnx.Rngs(3)), tokenizer, {"context_len": 2048})
    return out


@pytest.fixture(scope="module")
def long(long_model, tmp_path_factory):
    """A server on that model with 16 slots and no waiting queue: the 17th request is refused."""
    server = Server(long_model, tmp_path_factory.mktemp("serve") / "long.log", "--queue", "0")
    yield server
    server.stop()


def chat(server: Server, prompt: str, **settings) -> "openai.types.chat.ChatCompletion":
    messages = [{"role": "user", "content": prompt}]
    return server.client().chat.completions.create(model=NAME, messages=messages, **settings)


def streamed(server: Server, kind: str, **request) -> dict[int, tuple[str, str]]:
    """{choice: (text, finish_reason)} of a streamed request, through the openai client."""
    client = server.client()
    if kind == "chat":
        events = client.chat.completions.create(model=NAME, stream=True, **request)
    else:
        events = client.completions.create(model=NAME, stream=True, **request)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for event in events:
        for choice in event.choices:
            piece = choice.delta.content if kind == "chat" else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    return {i: (texts[i], finishes[i]) for i in sorted(texts)}


def test_models_lists_the_served_model(trained):
    assert [m.id for m in trained.client().models.list()] == [NAME]
    assert trained.client().models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        trained.client().models.retrieve("gpt-4o")


def test_a_taken_port_fails_in_one_line_before_the_model_loads(trained, tmp_path):
    result = run(["stagelm", "serve", str(tmp_path / "no-model"), "--port", str(trained.port)], tmp_path, check=False)
    assert result.returncode == 2
    assert result.stderr == (
        f"error: --port {trained.port}: cannot listen on 127.0.0.1:{trained.port} (Address already in use); "
        "choose another port\n"
    )


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_greedy_answer_equals_stagelm_generate(trained, pretrained, kind):
    prompt = "What is 41 plus 17?" if kind == "chat" else "Once upon a time,"
    flags = ["--chat"] if kind == "chat" else []
    cli = run(
        ["stagelm", "generate", str(pretrained), "--prompt", prompt, "--max-new-tokens", "24", *flags], Path.cwd()
    )
    if kind == "chat":
        answer = chat(trained, prompt, temperature=0, max_tokens=24)
        text, used = answer.choices[0].message.content, answer.usage.completion_tokens
    else:
        answer = trained.client().completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=24)
        text, used = answer.choices[0].text, answer.usage.completion_tokens
    assert text + "\n" == cli.stdout  # token for token: the same text from the same ids
    assert 0 < used <= 24


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streamed_and_whole_answers_agree(trained, kind):
    settings = {"temperature": 0.9, "top_p": 0.95, "seed": 11, "n": 3, "max_tokens": 20}
    if kind == "chat":
        request = {"messages": [{"role": "user", "content": "Write a sentence about Mia."}], **settings}
        whole = trained.client().chat.completions.create(model=NAME, **request)
        expected = {c.index: (c.message.content, c.finish_reason) for c in whole.choices}
    else:
        request = {"prompt": "Once upon a time,", **settings}
        whole = trained.client().completions.create(model=NAME, **request)
        expected = {c.index: (c.text, c.finish_reason) for c in whole.choices}
    assert streamed(trained, kind, **request) == expected
    assert len({text for text, _ in expected.values()}) > 1  # n choices are sampled apart


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streamed_usage_comes_last_when_asked_for(trained, kind):
    """stream_options.include_usage, as OpenAI defines it: `usage: null` on every chunk, then one
    chunk with no choices and the usage of all n choices, the one a whole answer reports."""
    request = {"temperature": 0.9, "seed": 3, "n": 2, "max_tokens": 12}
    client = trained.client()
    if kind == "chat":
        request["messages"] = [{"role": "user", "content": "What is 2 plus 2?"}]
        whole = client.chat.completions.create(model=NAME, **request)
        events = list(
            client.chat.completions.create(model=NAME, stream=True, **request, stream_options={"include_usage": True})
        )
    else:
        request["prompt"] = "Once upon a time,"
        whole = client.completions.create(model=NAME, **request)
        events = list(
            client.completions.create(model=NAME, stream=True, **request, stream_options={"include_usage": True})
        )
    *pieces, last = events
    assert last.choices == [] and last.usage.model_dump() == whole.usage.model_dump()
    assert pieces and all(e.usage is None and e.choices for e in pieces)
    plain = {"model": NAME, "prompt": "x", "max_tokens": 2, "stream": True}
    for options in (None, {"include_usage": False}):
        status, body = stream_lines(trained, {**plain, "stream_options": options})
        assert status == 200 and '"usage"' not in body  # absent or false: chunks as before
    for bad, words in (
        ({"stream_options": "yes"}, "expected an object"),
        ({"stream": False, "stream_options": {}}, "only allowed with stream"),
    ):
        status, answer, _ = trained.post("/v1/completions", {**plain, **bad})
        assert status == 400 and answer["error"]["param"] == "stream_options" and words in answer["error"]["message"]
    bad_flag = {**plain, "stream_options": {"include_usage": "yes"}}
    assert trained.post("/v1/completions", bad_flag)[0] == 400


def stream_lines(server: Server, body: dict) -> tuple[int, str]:
    """(status, the whole event stream as text) of a streamed POST."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read().decode()


def test_a_stop_string_cuts_the_answer_in_both_modes(long):
    request = {"prompt": "Once upon a time,", "temperature": 1.0, "seed": 5, "max_tokens": 24}  # varied text
    text = long.client().completions.create(model=NAME, **request).choices[0].text
    starts = [i for i in range(1, len(text) - 3) if text[i : i + 3].strip() and text.index(text[i : i + 3]) == i]
    assert starts, f"no stop string to cut {text!r} at"
    stop = text[starts[len(starts) // 2] :][:3]
    request["stop"] = [stop, "never seen"]
    cut = long.client().completions.create(model=NAME, **request).choices[0]
    assert (cut.text, cut.finish_reason) == (text[: text.index(stop)], "stop")
    assert streamed(long, "completion", **request) == {0: (cut.text, "stop")}


BAD = [  # (body, status, param or None, words of the message)
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "must be a JSON object"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature", ""),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}, 400, "max_tokens", ""),
    ({"model": NAME, "messages": "hi"}, 400, "messages", "non-empty list"),
    ({"model": NAME, "messages": [{"role": "system", "content": "be brief"}]}, 400, "messages", "must be the user's"),
    (
        {"model": NAME, "messages": [{"role": "tool", "content": "4"}, {"role": "user", "content": "hi"}]},
        400,
        "messages",
        "'tool' is not supported",
    ),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model", "not served here"),
    ({"model": NAME, "messages": [{"role": "user", "content": "word " * 500}]}, 400, "messages", "exceed the cache"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens", ""),
    (
        {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "max_completion_tokens": -1},
        400,
        "max_completion_tokens",
        "",
    ),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature", ""),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p", ""),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n", ""),
    (
        {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]},
        400,
        "stop",
        "",
    ),
    ({"model": NAME, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}, 413, None, "exceeds the limit"),
]


def test_bad_requests_get_an_error_object_and_the_server_keeps_serving(trained):
    good = {"model": NAME, "messages": [{"role": "user", "content": "What is 2 plus 2?"}], "max_tokens": 4}
    for body, status, param, words in BAD:
        got, answer, _ = trained.post("/v1/chat/completions", body)
        assert got == status, (body if isinstance(body, bytes) else str(body)[:80], answer)
        error = answer["error"]
        assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"
        assert trained.post("/v1/chat/completions", good)[0] == 200
    extras = {**good, "logit_bias": {}, "user": "someone", "frequency_penalty": 0, "an_unknown_field": [1]}
    assert trained.post("/v1/chat/completions", extras)[0] == 200  # unknown fields are ignored
    with pytest.raises(openai.BadRequestError, match="max_tokens: expected a positive integer"):
        chat(trained, "hi", max_tokens=-3)
    assert trained.get("/v1/nowhere")[0] == 404


def test_sixteen_concurrent_requests_decode_together(long):
    before = long.stats()
    prompts = [f"Once upon a time, {name}" for name in "ABCDEFGHIJKLMNOP"]
    request = {"temperature": 0, "max_tokens": 200}
    answers: dict[str, object] = {}
    start = threading.Barrier(len(prompts))

    def ask(prompt: str) -> None:
        client = long.client()
        start.wait()
        answers[prompt] = client.completions.create(model=NAME, prompt=prompt, **request).choices[0]

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(answers) == sorted(prompts) and all(a.finish_reason == "length" for a in answers.values())
    after = long.stats()
    steps = {int(k): v - before["steps_by_batch"].get(k, 0) for k, v in after["steps_by_batch"].items()}
    decoded_together = sum(n * count for n, count in steps.items() if n >= 8)
    assert decoded_together >= 0.8 * 16 * 200, steps  # nearly every token was decoded in a batch of 8 or more
    for prompt in prompts[:2]:  # batched ≡ alone
        alone = long.client().completions.create(model=NAME, prompt=prompt, **request).choices[0]
        assert alone.text == answers[prompt].text


def open_stream(server: Server, prompt: str) -> http.client.HTTPConnection:
    """A streaming request that has begun to answer (its first event read), left open."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": NAME, "prompt": prompt, "temperature": 0, "max_tokens": 2000, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    return conn


def test_a_full_server_refuses_at_once_and_a_closed_stream_frees_its_slot(long):
    before = long.stats()
    streams = [open_stream(long, f"Once upon a time, {i}") for i in range(16)]  # every slot, no queue
    status, answer, seconds = long.post("/v1/completions", {"model": NAME, "prompt": "One more", "max_tokens": 4})
    assert status == 429 and answer["error"]["type"] == "rate_limit_error" and seconds < 2
    for conn in streams:
        conn.close()
    deadline = time.time() + 30
    while long.stats()["active"] and time.time() < deadline:
        time.sleep(0.1)
    after = long.stats()
    assert after["active"] == 0 and after["cancelled"] - before["cancelled"] == 16
    assert after["rejected"] - before["rejected"] == 1
    assert long.post("/v1/completions", {"model": NAME, "prompt": "One more", "max_tokens": 4})[0] == 200


@pytest.mark.skipif(CHROMIUM is None, reason=NEEDS)
def test_the_chat_page_streams_a_reply_in_chromium(trained, tmp_path):
    prompt = "What is 41 plus 17?"
    expected = chat(trained, prompt, temperature=0).choices[0].message.content
    browser = Browser(tmp_path / "profile")
    try:
        browser.open(f"{trained.url}/?prompt={urllib.parse.quote(prompt)}")
        done = "document.querySelector('.turn.assistant[data-done=true]')"
        browser.wait_for(f"!!{done}")
        assert browser.evaluate("document.querySelector('.turn.user').textContent") == prompt
        assert browser.evaluate(f"{done}.textContent") == expected
        assert int(browser.evaluate(f"{done}.dataset.pieces")) > 1  # it arrived in pieces, as streamed
        assert browser.screenshot(tmp_path / "chat.png").stat().st_size > 5000
        assert {urllib.parse.urlsplit(u).netloc for u in browser.requests} == {f"127.0.0.1:{trained.port}"}
    finally:
        browser.close()


# --- abuse: what a web page, a slow client or a huge request can and cannot do ------------------


def raw(server: Server, head: bytes, body: bytes = b"", timeout: float = 30) -> tuple[int, dict]:
    """(status, JSON body) of one request written byte for byte (headers as a client chose them)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(head + b"\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1] or b"{}")


def post_head(server: Server, length: int, host: str | None = None, kind: str = "application/json") -> bytes:
    host = host or f"127.0.0.1:{server.port}"
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: {kind}\r\n"
        f"Content-Length: {length}\r\nConnection: close\r\n"
    ).encode()


def test_only_loopback_names_and_json_posts_reach_the_model(trained):
    body = json.dumps({"model": NAME, "prompt": "Once", "max_tokens": 2}).encode()
    for host in ("localhost", f"localhost:{trained.port}", f"127.0.0.1:{trained.port}", f"[::1]:{trained.port}"):
        assert raw(trained, post_head(trained, len(body), host), body)[0] == 200, host
    status, answer = raw(trained, post_head(trained, len(body), "attacker.example"), body)  # DNS rebinding
    assert status == 400 and "Host: 'attacker.example' is not a name of this server" in answer["error"]["message"]
    for kind in ("text/plain", "application/x-www-form-urlencoded"):  # what a cross-site form can send
        status, answer = raw(trained, post_head(trained, len(body), kind=kind), body)
        assert status == 415 and answer["error"]["type"] == "invalid_request_error", answer
    status, answer = raw(trained, b"DELETE /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n")
    assert status == 405 and answer["error"]["type"] == "invalid_request_error"


def test_what_http_itself_refuses_is_an_error_object_too(trained):
    """A head h11 refuses (a negative or 24-digit Content-Length, two Host headers) is answered as
    every other bad request is: an OpenAI error object with a 400, not uvicorn's plain text."""
    body = json.dumps({"model": NAME, "prompt": "Once", "max_tokens": 2}).encode()
    host = f"localhost:{trained.port}"
    heads = [
        post_head(trained, -5),
        post_head(trained, 10**23),
        post_head(trained, len(body)).replace(b"Host: ", f"Host: {host}\r\nHost: ".encode()),
    ]
    for head in heads:
        status, answer = raw(trained, head, body)
        assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer
        assert answer["error"]["message"].startswith("the request is not valid HTTP/1.1: "), answer
        assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert raw(trained, post_head(trained, len(body)), body)[0] == 200


def test_a_head_of_another_http_version_or_too_large_is_refused(trained):
    """h11 reads any `HTTP/d.d` and answers in 1.1, and bounds only a head still arriving: a request line
    of HTTP/2.0 (or 0.9, 1.2), or a head over 16 KiB sent in one write, is refused with an error object."""
    body = json.dumps({"model": NAME, "prompt": "Once", "max_tokens": 2}).encode()
    for version in ("2.0", "0.9", "1.2"):
        status, answer = raw(
            trained, post_head(trained, len(body)).replace(b"HTTP/1.1", f"HTTP/{version}".encode()), body
        )
        assert status == 400 and answer["error"]["message"] == (
            f"the request is not valid HTTP/1.1: HTTP/{version} is not served here; send HTTP/1.1"
        ), answer
    many = b"".join(f"X-Filler-{i}: {'a' * 1000}\r\n".encode() for i in range(100))  # 100 KB of headers
    for extra in (many, b"X-One: " + b"b" * 20_000 + b"\r\n", b"Cookie: " + b"c" * 17_000 + b"\r\n"):
        status, answer = raw(trained, post_head(trained, len(body)) + extra, body)
        assert status == 431 and answer["error"]["type"] == "invalid_request_error", answer
        assert (
            "bytes, more than the 16,384 this server reads; send fewer or shorter headers" in answer["error"]["message"]
        )
    assert raw(trained, post_head(trained, len(body)) + b"Cookie: " + b"c" * 12_000 + b"\r\n", body)[0] == 200
    assert raw(trained, post_head(trained, len(body)).replace(b"HTTP/1.1", b"HTTP/1.0"), body)[0] == 200


def test_the_page_cannot_be_broken_out_of_by_a_name():
    from stagelm.infer.serve import inline_json

    name = "</script><script>alert(1)</script>&"
    text = inline_json(name)
    assert "<" not in text and ">" not in text and json.loads(text) == name


TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
PARSE = [  # (body, param or None, words): every one a 400 with an error object, none a 500
    (b"[" * 200_000 + b"]" * 200_000, None, "nested too deeply"),
    (b'{"model": "%s", "prompt": "\\ud800"}' % NAME.encode(), "prompt", "lone surrogate"),
    ({"model": NAME, "messages": [{"role": "user", "content": "\ud800"}]}, "messages", "lone surrogate"),
    ({"model": NAME, "prompt": "x", "stop": ["s" * 257]}, "stop", "1 to 256 characters"),
    ({"model": NAME, "prompt": "x", "logprobs": 2}, "logprobs", "not supported"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs", "not supported"),
    ({"model": NAME, "prompt": "x", "echo": True}, "echo", "not supported"),
    ({"model": NAME, "prompt": "x", "best_of": 3}, "best_of", "best_of = n"),
    ({"model": NAME, "prompt": "x", "temperature": 10**400}, "temperature", "out of range"),
    ({"model": NAME, "prompt": "x", "top_p": -(10**400)}, "top_p", "out of range"),
    ({"model": NAME, "prompt": "x", "max_tokens": 10**400}, "max_tokens", "out of range"),
    ({"model": NAME, "prompt": "x", "suffix": " the end"}, "suffix", "not supported"),
    ({"model": NAME, "prompt": "x", "logit_bias": {"5": 100}}, "logit_bias", "not supported"),
    ({"model": NAME, "prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"model": NAME, "prompt": "x", "frequency_penalty": -1}, "frequency_penalty", "not supported"),
    (
        {"model": NAME, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
        "response_format",
        "not supported",
    ),
    (
        {"model": NAME, "messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": "required"},
        "tool_choice",
        "not supported",
    ),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "tools": [TOOL]}, "tools", "not supported"),
    (
        {"model": NAME, "messages": [{"role": "user", "content": "x"}], "tools": "yes", "tool_choice": "none"},
        "tools",
        'tools: expected a list of tool objects, got "yes"',
    ),
    ({"model": NAME, "prompt": "x", "user": 5}, "user", "user: expected str, got 5"),
    ({"model": NAME, "prompt": "x", "store": "yes"}, "store", 'store: expected bool, got "yes"'),
]


def test_what_fails_to_parse_is_a_400_and_neutral_openai_fields_pass(trained):
    for body, param, words in PARSE:
        path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, answer, _ = trained.post(path, data)
        assert status == 400 and answer["error"]["param"] == param and words in answer["error"]["message"], answer
        assert len(answer["error"]["message"]) < 200  # a 400-digit number is not echoed whole
    neutral = {"model": NAME, "prompt": "x", "max_tokens": 2, "logprobs": None, "echo": False, "best_of": 1}
    neutral |= {"suffix": "", "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0}
    assert trained.post("/v1/completions", neutral)[0] == 200
    chat = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tool_choice": "none"}
    chat |= {"tools": [TOOL], "response_format": {"type": "text"}}
    assert trained.post("/v1/chat/completions", chat)[0] == 200
    with socket.create_connection(("127.0.0.1", trained.port)) as s:  # a client that leaves mid-body
        s.sendall(post_head(trained, 5000) + b"\r\n" + b'{"model": "')
    assert trained.post("/v1/completions", neutral)[0] == 200
    assert "Traceback" not in trained.log.read_text() and "ClientDisconnect" not in trained.log.read_text()


def test_stop_strings_cost_no_more_than_their_bounded_length(long):
    stops = ["".join(chr(0x4E00 + (i * 7 + k) % 500) for k in range(256)) for i in range(4)]  # never generated
    body = {"model": NAME, "prompt": "Once upon a time,", "max_tokens": 400, "n": 16, "stop": stops, "temperature": 1}
    done: dict[str, float] = {}

    def ask() -> None:
        done["status"] = long.post("/v1/completions", body)[0]

    worker = threading.Thread(target=ask)
    worker.start()
    time.sleep(0.5)
    waits = []
    while worker.is_alive() and len(waits) < 50:  # the event loop answers while the long request decodes
        t0 = time.perf_counter()
        assert long.get("/v1/models")[0] == 200
        waits.append(time.perf_counter() - t0)
        time.sleep(0.05)
    worker.join(timeout=120)
    assert done["status"] == 200 and waits and max(waits) < 1.0, waits


def test_a_client_that_goes_away_frees_its_slots_without_streaming(long):
    short = {"model": NAME, "prompt": "Once upon a time,", "max_tokens": 40, "n": 16, "temperature": 1}
    for _ in range(5):  # rows that have ended are free by the time their answer arrives
        assert long.post("/v1/completions", short)[0] == 200 and long.stats()["active"] == 0
    before = long.stats()
    body = json.dumps(
        {"model": NAME, "prompt": "Once upon a time,", "max_tokens": 1500, "n": 4, "temperature": 0}
    ).encode()
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", long.port)) as s:
            s.sendall(post_head(long, len(body)) + b"\r\n" + body)
            deadline = time.time() + 30
            while long.stats()["active"] < 4 and time.time() < deadline:  # it is decoding
                time.sleep(0.02)
        deadline = time.time() + 30
        while long.stats()["active"] and time.time() < deadline:  # gone: its rows are freed
            time.sleep(0.02)
    after = long.stats()
    assert after["active"] == 0 and after["cancelled"] - before["cancelled"] == 12  # freed, not run to the end
    assert after["tokens"] - before["tokens"] < 3 * 4 * 1500 / 2  # nowhere near the 18,000 they asked for


def serve_flags(model: Path, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    return run(["stagelm", "serve", str(model), *flags], tmp_path, check=False, timeout=120)


def test_ports_and_slots_are_checked_before_the_model_loads(long_model, tmp_path):
    for port in ("70000", "-1"):
        result = serve_flags(long_model, tmp_path, "--port", port)
        assert result.returncode == 2 and result.stderr == (
            f"error: --port: expected 0 to 65535 (0 = any free port), got {port}\n"
        )
    bounds = (("--slots", "100000", "1 to 1024 requests decoded together"), ("--queue", "10000000", "0 to 65536"))
    for flag, value, bound in bounds:
        result = serve_flags(long_model, tmp_path, "--port", "0", flag, value)
        assert result.returncode == 2 and result.stderr.startswith(f"error: {flag}: expected {bound}"), result.stderr
        assert result.stderr.endswith(f", got {value}\n") and result.stderr.count("\n") == 1
    result = serve_flags(long_model, tmp_path, "--port", "0", "--allow-host", "")
    assert result.returncode == 2 and result.stderr == "error: --allow-host: expected a host name, got ''\n"
    result = serve_flags(long_model, tmp_path, "--port", "0", "--host", "192.0.2.1")  # TEST-NET-1: no machine's own
    assert result.returncode == 2 and result.stderr == (
        "error: --host 192.0.2.1: cannot listen on 192.0.2.1:0 (Cannot assign requested address); "
        "give an address of this machine, such as 127.0.0.1\n"
    )
    looping = tmp_path / "looping"  # a chat.json whose template no request could get through
    shutil.copytree(long_model, looping)
    spec = {"template": "{% for i in range(10**12) %}x{% endfor %}", "bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    spec |= {"pad_token": "<|pad|>", "stop_tokens": ["<|eos|>", "<|end|>"], "add_bos_token": False, "unk_token": None}
    (looping / "chat.json").write_text(json.dumps(spec))
    result = serve_flags(looping, tmp_path, "--port", "0")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: {looping / 'chat.json'}: its chat template cannot render one user turn (")
    huge = tmp_path / "huge"  # a context of a million positions: 1,024 slots of it hold 64 GiB of KV cache
    shutil.copytree(long_model, huge)
    config = json.loads((huge / "config.json").read_text())
    (huge / "config.json").write_text(json.dumps({**config, "context_len": 1 << 20}))
    result = serve_flags(huge, tmp_path, "--port", "0", "--slots", "1024")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: --slots: 1024 slots × 1048576 positions of KV cache needs ")
    assert "GiB, but " in result.stderr and "is available; lower it" in result.stderr


def test_sigterm_stops_a_server_without_pipeline_advice(long_model, tmp_path):
    """A server is no stage: stopped while it loads and compiles, it says which signal stopped
    it and nothing about `dvc repro` or checkpoints; once serving, uvicorn stops it quietly."""
    for compiling in (True, False):  # during the warm-up (16 batch sizes to compile), then once it serves
        log = tmp_path / f"serve-{compiling}.log"
        if compiling:
            cmd = ["stagelm", "serve", str(long_model), "--port", "0"]
            proc = subprocess.Popen(cmd, env=env_with_venv(), stdout=log.open("w"), stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 60
            while "compiling" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert proc.poll() is None and "on http://" not in log.read_text()  # loaded, still compiling
        else:
            proc = Server(long_model, log).proc
        proc.terminate()
        proc.wait(timeout=30)
        text = log.read_text()
        assert "dvc repro" not in text and "checkpoint" not in text and "Traceback" not in text, text
        if proc.returncode == 128 + 15:  # stopped by stagelm's own handler
            assert text.strip().splitlines()[-1] == "interrupted by SIGTERM", text


def test_slow_clients_cannot_lock_out_a_good_one(long_model, tmp_path):
    """Slowloris: 300 connections that never finish their head, against a server allowed 256
    descriptors; a good client started after them is answered once the head deadline drops them."""
    log = tmp_path / "slow.log"
    serve = ["stagelm", "serve", str(long_model), "--port", "0", "--name", NAME, "--header-timeout", "2"]
    cmd = ["prlimit", "--nofile=256:256", *serve]  # util-linux; a preexec_fn would fork this threaded process
    proc = subprocess.Popen(cmd, env=env_with_venv(), stdout=log.open("w"), stderr=subprocess.STDOUT)
    stalled: list[socket.socket] = []
    try:
        deadline = time.time() + 180
        while "on http://" not in log.read_text() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        announced = log.read_text().split("http://127.0.0.1:")[1].split()[0]
        port = int(announced)
        assert port != 0  # port 0: the one the system gave is announced
        for _ in range(300):
            s = socket.socket()
            s.settimeout(5)
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n")  # and never the blank line
            stalled.append(s)
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/v1/models")
        assert conn.getresponse().status == 200
        assert time.perf_counter() - t0 < 2 + 2  # the header deadline, plus 2 s
        assert log.read_text().count("\n") == 2  # the two serve lines alone: no accept() errors logged
    finally:
        for s in stalled:
            s.close()
        proc.terminate()
        proc.wait(timeout=30)


def looping_model(long_model: Path, folder: Path) -> Path:
    """The long model with a chat template that loops (far past its time budget) on the message 'loop'."""
    model = folder / "model"
    shutil.copytree(long_model, model)
    hang = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    template = (
        "{% for m in messages %}{% if m.content == 'loop' %}" + hang + "{% endif %}"
        "<|user|>{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    write_chat_spec(model, {"template": template, "eos_token": "<|eos|>", "pad_token": "<|pad|>", "stop_tokens": []})
    return model


def test_a_model_from_elsewhere_brings_its_template_under_budget_and_its_sampling_default(long_model, tmp_path):
    """A chat template is code from elsewhere: one that loops on some content is refused once its
    time budget is spent (a 400 naming the budget, not the server's files), and while it runs,
    rendered off the event loop, other requests are answered. The model's generation_config.json
    (here temperature 0) is the default of a request that gives no temperature."""
    model = looping_model(long_model, tmp_path)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    server = Server(model, tmp_path / "serve.log")
    try:
        assert "sampling defaults from its generation_config.json: temperature 0" in server.log.read_text()
        request = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "n": 2}
        texts = {}
        for temperature in (None, 0.0, 1.0):
            body = request if temperature is None else {**request, "temperature": temperature}
            status, answer, _ = server.post("/v1/chat/completions", body)
            assert status == 200
            texts[temperature] = [c["message"]["content"] for c in answer["choices"]]
        assert texts[None] == texts[0.0] and texts[None][0] == texts[None][1]  # greedy, by the model's default
        assert texts[1.0][0] != texts[1.0][1]  # two samples of this untrained model differ
        looping: dict[str, tuple] = {}
        body = {"model": NAME, "messages": [{"role": "user", "content": "loop"}], "max_tokens": 2}
        hog = threading.Thread(target=lambda: looping.update(answer=server.post("/v1/chat/completions", body)))
        hog.start()
        time.sleep(0.3)
        t0 = time.perf_counter()
        assert server.get("/v1/models")[0] == 200
        quick = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        status, answer, _ = server.post("/v1/chat/completions", quick)
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
        assert time.perf_counter() - t0 < MAX_RENDER_SECONDS / 2  # answered while the loop still runs
        assert hog.is_alive()
        hog.join()
        status, error, seconds = looping["answer"]
        assert status == 400 and seconds < MAX_RENDER_SECONDS + 2, (status, error, seconds)
        assert error["error"]["message"] == f"the chat template took more than {MAX_RENDER_SECONDS:g} s to render"
        assert error["error"]["param"] == "messages"
    finally:
        server.stop()


def test_templates_that_loop_stall_neither_another_request_nor_shutdown(long_model, tmp_path):
    """60 requests whose template loops until its budget is spent (within the 16 slots and 64 queued
    a server takes): an ordinary request sent beside them waits a slice of each, not their budgets;
    and SIGTERM during 20 such renderings ends them and the server at once."""
    server = Server(looping_model(long_model, tmp_path), tmp_path / "serve.log")
    looping = {"model": NAME, "messages": [{"role": "user", "content": "loop"}], "max_tokens": 2}
    answers: list = []

    def post() -> None:
        try:
            answers.append(server.post("/v1/chat/completions", looping))
        except OSError as err:  # the server stopped under it
            answers.append(err)

    try:
        hogs = [threading.Thread(target=post) for _ in range(60)]
        for hog in hogs:
            hog.start()
        time.sleep(0.5)
        quick = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        status, answer, seconds = server.post("/v1/chat/completions", quick)
        assert status == 200 and seconds < MAX_RENDER_SECONDS, (status, seconds)
        for hog in hogs:
            hog.join()
        assert len(answers) == 60 and all(a[0] == 400 and "took more than" in a[1]["error"]["message"] for a in answers)
        answers.clear()
        hogs = [threading.Thread(target=post) for _ in range(20)]
        for hog in hogs:
            hog.start()
        time.sleep(0.5)
        t0 = time.perf_counter()
        server.proc.terminate()
        server.proc.wait(timeout=30)
        assert time.perf_counter() - t0 < MAX_RENDER_SECONDS / 2, time.perf_counter() - t0
        for hog in hogs:
            hog.join()
        stopped = [a for a in answers if not isinstance(a, OSError)]
        assert all(a[0] == 503 and "the server is stopping" in a[1]["error"]["message"] for a in stopped), stopped
        assert "Traceback" not in server.log.read_text()
    finally:
        server.stop()
