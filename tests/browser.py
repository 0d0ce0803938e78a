"""A real headless Chromium (Debian's `chromium` package, installed by `scripts/bootstrap --dev`)
driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: JSON messages ended by
NUL on file descriptors 3 and 4), so the tests need no websocket client and no browser
download. It loads a page as a person would, answers the login dialog of HTTP Basic auth as a
person types into it, and reads back what the page shows after load.

    with Chromium() as browser:
        browser.login("any", token)
        browser.open("http://127.0.0.1:9400/")
        title = browser.evaluate("document.title")
        browser.screenshot(path)
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["FLAGS", "Chromium", "chromium_binary"]

# What works on a machine with no display, no GPU and no network but loopback: no sandbox (as
# root), no background traffic to anyone's service, a fresh profile per browser.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--remote-debugging-pipe")


def chromium_binary() -> str | None:
    """Path of Debian's chromium, or None when it is not installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Chromium:
    """One headless browser with one page (tab); `log` holds what its console and its security
    checks said (a CSP violation is a "security" entry)."""

    def __init__(self, width: int = 1280, height: int = 900, timeout_s: float = 30.0) -> None:
        binary = chromium_binary()
        if binary is None:
            raise FileNotFoundError("chromium is not installed (Debian package chromium; "
                                    "scripts/bootstrap --dev installs it)")
        self.timeout_s = timeout_s
        self.log: list[dict[str, Any]] = []
        # Chromium's helper processes may still write into the profile for a moment after the
        # browser exits: what they leave is not the test's failure.
        self._profile = tempfile.TemporaryDirectory(prefix="guard-chromium-",
                                                    ignore_cleanup_errors=True)
        to_browser, self._write = os.pipe()
        self._read, from_browser = os.pipe()

        def fds() -> None:  # in the child: the protocol's two descriptors, 3 in and 4 out
            # Moved out of the way first: either pipe may be descriptor 3 or 4 already.
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser, from_browser)]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self._process = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self._profile.name}",
             f"--window-size={width},{height}", "about:blank"],
            pass_fds=(3, 4), preexec_fn=fds,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._id = 0
        self._credentials: tuple[str, str] | None = None
        target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self._call("Target.attachToTarget",
                                   {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    # -- what a test does --------------------------------------------------------------------

    def login(self, username: str | None, password: str = "") -> None:
        """Answer every login dialog (HTTP auth) with these, as a person would type them;
        `username` None: press Cancel, and see the page the 401 came with."""
        self._credentials = None if username is None else (username, password)
        self.call("Fetch.enable", {"handleAuthRequests": True, "patterns": [{"urlPattern": "*"}]})

    def open(self, url: str) -> dict[str, Any]:
        """Load `url` and wait for its load event; the navigation's answer (errorText on a
        failure)."""
        answer = self.call("Page.navigate", {"url": url})
        self.wait_for("Page.loadEventFired")
        return answer

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (the test's own, never the page's:
        the page may run no script)."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        """The whole page as a PNG."""
        data = self.call("Page.captureScreenshot", {"format": "png",
                                                    "captureBeyondViewport": True})["data"]
        path.write_bytes(base64.b64decode(data))

    # -- the protocol ------------------------------------------------------------------------

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """A command to the page's session; its result."""
        return self._call(method, params, self._session)

    def wait_for(self, event: str) -> dict[str, Any]:
        """The params of the next `event` of the page's session."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            message = self._next(deadline)
            if message.get("method") == event and message.get("sessionId") == self._session:
                params: dict[str, Any] = message.get("params", {})
                return params

    def _call(self, method: str, params: dict[str, Any] | None = None,
              session: str | None = None) -> dict[str, Any]:
        self._id += 1
        sent = self._id
        message: dict[str, Any] = {"id": sent, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout_s
        while True:
            reply = self._next(deadline)
            if reply.get("id") == sent:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result

    def _next(self, deadline: float) -> dict[str, Any]:
        """The next message from the browser; events that need an answer are answered here."""
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read], [], [], left)[0]:
                raise TimeoutError(f"chromium said nothing for {self.timeout_s} s")
            chunk = os.read(self._read, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium exited")
            self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        message: dict[str, Any] = json.loads(raw)
        self._answer(message)
        return message

    def _answer(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Log.entryAdded":
            self.log.append(params["entry"])
        elif method == "Runtime.consoleAPICalled":
            self.log.append({"source": "console", "text": str(params.get("args"))})
        elif method == "Fetch.requestPaused":
            self._send("Fetch.continueRequest", {"requestId": params["requestId"]})
        elif method == "Fetch.authRequired":
            user, password = self._credentials or ("", "")
            answer = "CancelAuth" if self._credentials is None else "ProvideCredentials"
            self._send("Fetch.continueWithAuth", {"requestId": params["requestId"],
                                                  "authChallengeResponse": {
                                                      "response": answer, "username": user,
                                                      "password": password}})

    def _send(self, method: str, params: dict[str, Any]) -> None:
        """A command whose answer nobody waits for (it is read, and skipped, later)."""
        self._id += 1
        os.write(self._write, json.dumps({"id": self._id, "method": method, "params": params,
                                          "sessionId": self._session}).encode() + b"\0")

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._profile.cleanup()

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
