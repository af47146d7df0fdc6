"""Headless Chromium driven over the DevTools protocol, for the frontend test and the example
thumbnails (tests/integration/example_thumbnails.py).

Chromium is Debian's (`apt-get install chromium`); the client below uses aiohttp, which ComfyUI
itself depends on, so nothing beyond a ComfyUI venv is needed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
WINDOW = (1280, 900)
BROWSER_START_TIMEOUT_S = 30.0
CDP_CALL_TIMEOUT_S = 60.0

# Page-side handles. The shims in /scripts/*.js read window.comfyAPI in every frontend version
# tested (1.27 to 1.49), so the page's app and api are taken from there.
JS_APP = "window.comfyAPI?.app?.app"
JS_API = "window.comfyAPI?.api?.api"
JS_READY = f"""(() => {{
  const app = {JS_APP};
  // Node definitions are registered after every extension has loaded; the first (blank)
  // workflow opens after that, and would replace a graph loaded before it (1.49).
  return !!(app && app.graph && globalThis.LiteGraph?.registered_node_types?.["ToMA"]
            && app.extensionManager?.workflow?.activeWorkflow);
}})()"""


@dataclass(frozen=True)
class ConsoleEntry:
    """One console message, page exception or browser log entry."""

    source: str  # "console", "exception", or Log.entryAdded's source ("network", ...)
    level: str
    text: str
    url: str = ""


def find_chromium() -> str | None:
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


@contextlib.contextmanager
def running_chromium(executable: str, profile: Path,
                     window: tuple[int, int] = WINDOW) -> Iterator[int]:
    """Headless Chromium with DevTools on a port it picks itself; yields that port."""
    command = [executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--hide-scrollbars",
               f"--window-size={window[0]},{window[1]}", "--force-device-scale-factor=1",
               "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"]
    log_path = profile.parent / "chromium.log"
    with log_path.open("w") as log_file:
        # Its own process group: a browser that has to be killed takes its renderers along.
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        yield _devtools_port(process, profile / "DevToolsActivePort", log_path)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def _devtools_port(process: subprocess.Popen, port_file: Path, log_path: Path) -> int:
    # With --remote-debugging-port=0 Chromium writes the port it chose into the profile.
    deadline = time.monotonic() + BROWSER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"chromium exited ({process.returncode}): "
                               f"{log_path.read_text()[-2000:]}")
        if port_file.is_file():
            lines = port_file.read_text().splitlines()
            if lines and lines[0].isdigit():
                return int(lines[0])
        time.sleep(0.2)
    raise RuntimeError(f"chromium did not open DevTools: {log_path.read_text()[-2000:]}")


class Cdp:
    """Minimal DevTools protocol client for one page: calls, and console events kept."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.console: list[ConsoleEntry] = []
        self.responses: list[tuple[str, int]] = []  # (URL, HTTP status) of every response
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for frame in self._ws:
            if frame.type != aiohttp.WSMsgType.TEXT:
                continue
            message = json.loads(frame.data)
            future = self._pending.pop(message.get("id", -1), None)
            if future is not None and not future.done():
                future.set_result(message)
            elif "method" in message:
                self._record(message["method"], message.get("params", {}))
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError("DevTools connection closed"))

    def _record(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(arg.get("value", arg.get("description", "")))
                            for arg in params.get("args", []))
            level = "error" if params.get("type") in ("error", "assert") else params.get("type")
            self.console.append(ConsoleEntry("console", str(level), text))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text", "")
            self.console.append(ConsoleEntry("exception", "error", text, details.get("url", "")))
        elif method == "Network.responseReceived":
            response = params.get("response", {})
            self.responses.append((response.get("url", ""), int(response.get("status", 0))))
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            self.console.append(ConsoleEntry(entry.get("source", "log"), entry.get("level", ""),
                                             entry.get("text", ""), entry.get("url", "")))

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        await self._ws.send_json({"id": call_id, "method": method, "params": params})
        reply = await asyncio.wait_for(future, CDP_CALL_TIMEOUT_S)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def evaluate(self, expression: str) -> Any:
        """The value of a JS expression (promises awaited); page exceptions raise here."""
        result = await self.call("Runtime.evaluate", expression=expression, awaitPromise=True,
                                 returnByValue=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise RuntimeError(details.get("exception", {}).get("description")
                               or details.get("text"))
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, timeout: float, what: str) -> Any:
        """Poll until the expression is truthy; its value."""
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                value = await self.evaluate(expression)
            except RuntimeError as exc:  # e.g. no execution context yet while navigating
                last_error = exc
            else:
                if value:
                    return value
            await asyncio.sleep(0.25)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} "
                             f"(last error: {last_error})")

    async def frames(self, count: int = 2) -> None:
        """Let the page draw `count` animation frames (canvas and Vue updates land by then)."""
        await self.evaluate(f"new Promise((done) => {{ let n = {count}; const step = () => "
                            "(--n > 0 ? requestAnimationFrame(step) : done(true)); "
                            "requestAnimationFrame(step); })")

    async def screenshot(self, clip: dict[str, float] | None = None, fmt: str = "png",
                         quality: int = 90) -> bytes:
        """The page as drawn, or the `clip` {x, y, width, height} of it (CSS pixels)."""
        params: dict[str, Any] = {"format": fmt}
        if fmt == "jpeg":
            params["quality"] = quality
        if clip is not None:
            params["clip"] = {**clip, "scale": 1}
        result = await self.call("Page.captureScreenshot", **params)
        return base64.b64decode(result["data"])

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


async def _page_socket_url(session: aiohttp.ClientSession, port: int) -> str:
    async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
        targets = await response.json(content_type=None)
    pages = [t for t in targets if t.get("type") == "page"]
    assert pages, f"no page target in {targets}"
    return pages[0]["webSocketDebuggerUrl"]


@contextlib.asynccontextmanager
async def comfy_page(port: int, url: str, ready_timeout: float) -> AsyncIterator[Cdp]:
    """The browser's page with ComfyUI's UI at `url` loaded and the pack's nodes registered."""
    async with aiohttp.ClientSession() as session:
        ws_url = await _page_socket_url(session, port)
        async with session.ws_connect(ws_url, max_msg_size=0) as ws:
            cdp = Cdp(ws)
            try:
                for domain in ("Runtime", "Log", "Page", "Network"):
                    await cdp.call(f"{domain}.enable")
                await cdp.call("Page.navigate", url=url)
                await cdp.wait_for(JS_READY, ready_timeout,
                                   "the ComfyUI app with the ToMA node registered")
                yield cdp
            finally:
                await cdp.close()


async def reload(cdp: Cdp, ready_timeout: float) -> None:
    """Reload the page (as after changing the language) and wait until ComfyUI is ready."""
    # A mark on the old page: until it is gone, JS_READY may still be the old page's answer.
    await cdp.evaluate("window.tomaBeforeReload = true")
    await cdp.call("Page.reload")
    await cdp.wait_for(f"!window.tomaBeforeReload && {JS_READY}", ready_timeout,
                       "the reloaded ComfyUI app")


async def click(cdp: Cdp, x: float, y: float) -> None:
    """A left click of the mouse at page point (x, y), as a person makes it."""
    for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
        await cdp.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left",
                       clickCount=1)


async def load_workflow(cdp: Cdp, workflow: dict[str, Any]) -> None:
    """Open a UI-format workflow as the user's current graph."""
    await cdp.evaluate(f"{JS_APP}.loadGraphData({json.dumps(workflow)}).then(() => true)")
    await cdp.frames()
