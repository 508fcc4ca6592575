"""`stagelm serve` in its own process, for the tests that talk to it as clients do."""

import http.client
import json
import subprocess
import time
from pathlib import Path

import openai
from conftest import env_with_venv, free_port

NAME = "stagelm-test"


class Server:
    """`stagelm serve <model> --port <free port>` in its own process, until `stop`."""

    def __init__(self, model: Path, log: Path, *flags: str):
        self.port = free_port()
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
