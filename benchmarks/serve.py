"""How `stagelm serve` batches: concurrent requests against the same requests one by one.

    python benchmarks/serve.py [--model runs/sft/model] [--requests 16] [--max-tokens 64]

Starts `stagelm serve` on a free loopback port and measures, on the default pipeline's
SFT model:

- a lone chat request's wall time over HTTP, against the same greedy answer from the
  generator `stagelm generate` uses, timed in this process after a warm-up (the token
  loop alone: no process start, no model load) — batching must add no waiting;
- total completion tokens/s of N requests sent one after another, and of 1, 8 and N
  sent at once (continuous batching should make N at once several times faster);
- the server's own counters: decode steps by batch size.

Prints a markdown table and the machine line; writes nothing.
"""

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import jax

from stagelm.infer.generate import Sampling, load_generator
from stagelm.measure.microbench import matmul_gflops

PROMPTS = [
    "Once upon a time,",
    "The little fox",
    "Mia found a lamp",
    "In the morning, Omar",
    "The river was",
    "A dog named Max",
    "Lucy and Tom went to the park.",
    "The candle",
]


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def start_server(model: Path) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stagelm = str(Path(sys.executable).with_name("stagelm"))  # the venv's, beside this python
    proc = subprocess.Popen([stagelm, "serve", str(model), "--port", str(port), "--name", "m"])
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return proc, port
        except OSError:
            time.sleep(0.3)
    proc.kill()
    sys.exit("stagelm serve did not start")


def burst(port: int, count: int, max_tokens: int) -> tuple[float, int]:
    """(seconds, completion tokens) of `count` completion requests sent at once."""
    used = [0] * count
    start = threading.Barrier(count + 1)

    def one(i: int) -> None:
        body = {"model": "m", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0}
        start.wait()
        used[i] = post(port, "/v1/completions", body)["usage"]["completion_tokens"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, sum(used)


def one_by_one(port: int, count: int, max_tokens: int) -> tuple[float, int]:
    t0, used = time.perf_counter(), 0
    for i in range(count):
        body = {"model": "m", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0}
        used += post(port, "/v1/completions", body)["usage"]["completion_tokens"]
    return time.perf_counter() - t0, used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("runs/sft/model"))
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    question = "What is 41 plus 17?"
    gen = load_generator(args.model)
    cases = {  # name: (prompt ids, chat, max tokens, the request's path and body)
        "chat answer": (
            gen.chat.user_prompt(question),
            True,
            32,
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": question}], "max_tokens": 32, "temperature": 0},
        ),
        "completion": (
            gen.tokenizer.encode(PROMPTS[0], add_special_tokens=False).ids,
            False,
            args.max_tokens,
            "/v1/completions",
            {"model": "m", "prompt": PROMPTS[0], "max_tokens": args.max_tokens, "temperature": 0},
        ),
    }
    generate_s, references = {}, {}
    for name, (ids, chat, max_new, _, _) in cases.items():
        times = []
        for _ in range(args.repeats + 1):  # the first compiles
            t0 = time.perf_counter()
            references[name] = list(gen.stream(ids, max_new, Sampling(), jax.random.key(0), chat=chat))
            times.append(time.perf_counter() - t0)
        generate_s[name] = statistics.median(times[1:])

    proc, port = start_server(args.model)
    try:
        lone_s = {}
        conn = http.client.HTTPConnection("127.0.0.1", port)  # kept alive, as a client library keeps it
        for name, (_, chat, _, path, body) in cases.items():
            times = []
            for _ in range(args.repeats + 1):  # the first compiles this prompt width's prefill
                t0 = time.perf_counter()
                conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
                answer = json.loads(conn.getresponse().read())
                times.append(time.perf_counter() - t0)
            lone_s[name] = statistics.median(times[1:])
            choice = answer["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            assert text == gen.tokenizer.decode(references[name], skip_special_tokens=False)
        conn.close()

        burst(port, args.requests, args.max_tokens)  # compile every prompt width and batch size once
        rows = []
        seconds, tokens = one_by_one(port, args.requests, args.max_tokens)
        sequential = tokens / seconds
        rows.append((f"{args.requests} one after another", 1, seconds, tokens, sequential))
        for concurrent in sorted({1, 8, args.requests}):
            seconds, tokens = burst(port, concurrent, args.max_tokens)
            rows.append((f"{concurrent} at once", concurrent, seconds, tokens, tokens / seconds))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/stats") as response:
            stats = json.loads(response.read())
    finally:
        proc.terminate()
        proc.wait()

    print(f"\nmodel {args.model}; {args.requests} completion requests of at most {args.max_tokens} tokens, greedy\n")
    print("| requests | concurrent | wall s | completion tokens | tokens/s | vs one after another |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, concurrent, seconds, tokens, rate in rows:
        print(f"| {name} | {concurrent} | {seconds:.2f} | {tokens} | {rate:,.0f} | {rate / sequential:.2f}x |")
    print("\n| a lone request | tokens | over HTTP ms | `stagelm generate`'s token loop ms | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name in cases:
        ms, ref_ms = lone_s[name] * 1000, generate_s[name] * 1000
        print(f"| {name} | {len(references[name])} | {ms:.1f} | {ref_ms:.1f} | {ms / ref_ms:.2f}x |")
    print(f"decode steps by batch size: {stats['steps_by_batch']}")
    avx512 = sum("avx512" in line for line in Path("/proc/cpuinfo").read_text().splitlines())
    print(
        f"machine: {len(jax.devices())} CPU device, avx512 lines in /proc/cpuinfo: {avx512}, "
        f"2048² fp32 matmul {matmul_gflops():.0f} GFLOP/s"
    )


if __name__ == "__main__":
    main()
