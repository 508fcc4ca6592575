"""`stagelm serve` as clients see it: the official openai client, raw HTTP and a browser
against real server processes on free loopback ports."""

import http.client
import json
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
from tokenizers import Tokenizer

from stagelm.model import Decoder, DecoderConfig
from stagelm.modeldir import save_model

WHY = "the serve tests need the serve extra and the openai client: pip install -e '.[serve,serve-test]' (.ci/run does)"
openai = pytest.importorskip("openai", reason=WHY)
pytest.importorskip("starlette", reason=WHY)
pytest.importorskip("uvicorn", reason=WHY)

pytestmark = pytest.mark.slow

NAME = "stagelm-test"


class Server:
    """`stagelm serve <model> --port <free port>` in its own process, until `stop`."""

    def __init__(self, model: Path, log: Path, *flags: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = log
        cmd = ["stagelm", "serve", str(model), "--port", str(self.port), "--name", NAME, *flags]
        self.proc = subprocess.Popen(cmd, env=env_with_venv(), stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"stagelm serve exited {self.proc.returncode}:\n{log.read_text()}")
            try:
                if self.get("/v1/models")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"stagelm serve did not answer within 180 s:\n{log.read_text()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def get(self, path: str) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, json.loads(response.read())

    def post(self, path: str, body: bytes | dict) -> tuple[int, dict, float]:
        """(status, JSON body, seconds) of one POST."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        t0 = time.perf_counter()
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read()), time.perf_counter() - t0

    def stats(self) -> dict:
        return self.get("/v1/stats")[1]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


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
    ({"model": NAME, "messages": [{"role": "system", "content": "be brief"}]}, 400, "messages", "'system' is not"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model", "not served here"),
    ({"model": NAME, "messages": [{"role": "user", "content": "word " * 500}]}, 400, "messages", "exceed the cache"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens", ""),
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
