"""Headless Chromium driven over the DevTools protocol (its `--remote-debugging-pipe`), for
tests that look at a page as a person's browser shows it: wait for what a script
writes, read the DOM, list every URL the page requested, take a screenshot.

Debian's `chromium` package is the browser; nothing else is needed (no driver, no
websocket client). The browser's own background traffic is switched off with flags,
so the requests recorded are the page's.
"""

import base64
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NEEDS = "needs Debian's chromium (apt-get install chromium; .ci/run installs it)"

FLAGS = [
    "--headless",
    "--no-sandbox",  # tests run as root
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-sync",
    "--metrics-recording-only",
    "--no-first-run",
    "--no-default-browser-check",
    "--window-size=1000,700",
]


class Browser:
    """One headless Chromium with one page; `requests` collects every URL the page asks for."""

    def __init__(self, profile: Path):
        commands_read, self._commands = os.pipe()
        self._replies, replies_write = os.pipe()
        cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"]
        # The protocol's fds: the browser reads 3 and writes 4. bash puts the pipes there (dash takes one digit),
        # so no Python runs between fork and exec (JAX's threads make that unsafe).
        wire = f'exec "$@" 3<&{commands_read} 4>&{replies_write}'
        self.proc = subprocess.Popen(
            ["bash", "-c", wire, "bash", *cmd], pass_fds=(commands_read, replies_write), stderr=subprocess.DEVNULL
        )
        os.close(commands_read)
        os.close(replies_write)
        self._buffer = b""
        self._next_id = 0
        self.requests: list[str] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Network.enable", session=True)
        self.call("Page.enable", session=True)

    def _message(self, timeout: float) -> dict[str, Any]:
        deadline = time.time() + timeout
        while b"\0" not in self._buffer:
            if time.time() > deadline:
                raise TimeoutError("chromium sent nothing")
            chunk = os.read(self._replies, 1 << 16)
            if not chunk:
                raise ConnectionError("chromium closed its protocol pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: bool = False, timeout: float = 60, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._message(timeout)
            if reply.get("method") == "Network.requestWillBeSent":
                self.requests.append(reply["params"]["request"]["url"])
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def open(self, url: str) -> None:
        self.call("Page.navigate", session=True, url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60) -> Any:
        """Poll `expression` in the page until it is truthy; its value."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.1)
        raise TimeoutError(f"the page never made {expression!r} true")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        os.close(self._commands)
        os.close(self._replies)
