"""The pack's frontend extension in ComfyUI's real frontend, in headless Chromium.

One browser session per module (the frontend takes a while to load): it opens the UI served by
a real ComfyUI (comfy_server.py), loads an example workflow holding a ToMA node, delivers a
simulated "toma.stats" event and then a real one from a queued run, and records what the page
did; the tests below check parts of that record. Chromium is driven over the DevTools protocol
by the small client here (aiohttp, which ComfyUI itself depends on).

Skipped without Chromium (Debian: `apt-get install chromium`) or when the ComfyUI under test
does not serve its frontend (the comfyui-frontend-package pip package).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import comfy_server
import toma_pack
from comfy_server import ComfyServer

log = logging.getLogger(__name__)

WORKFLOW = comfy_server.REPO_ROOT / "example_workflows" / "sdxl_toma_txt2img.json"
EXTENSION_NAME = "toma.stats"  # app.registerExtension({name}) in web/toma_stats.js
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
BROWSER_START_TIMEOUT_S = 30.0
UI_TIMEOUT_S = 120.0
CDP_CALL_TIMEOUT_S = 60.0
STATS_TIMEOUT_S = 20.0
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")  # plus combos (option lists)

SIMULATED_STATS = {"ratio": 0.5, "layers_merged": 5, "layers_total": 17, "steps_merged": 2,
                   "steps_total": 2, "planning_s": 0.01, "sampling_s": 1.0}
# What web/toma_stats_format.js makes of SIMULATED_STATS.
SIMULATED_TEXT = "50% merged · 5/17 layers · 2/2 steps · planning 1% of step time"

# Page-side helpers. The shims in /scripts/*.js read window.comfyAPI in every frontend version
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
JS_EXTENSIONS = f"({JS_APP}.extensions ?? []).map((e) => e.name)"
JS_TOMA_NODES = f"""(() => {{
  const nodes = {JS_APP}.graph.findNodesByType("ToMA") ?? [];
  return nodes.map((n) => ({{id: n.id, widgets: (n.widgets ?? []).map((w) => [w.name, w.value])}}));
}})()"""


def _node_text(node_id: str) -> str:
    return f"{JS_APP}.graph.getNodeById({json.dumps(node_id)})?.toma_stats?.text ?? null"


# Text that ties a console entry to the pack (its folder, script names, event, warn prefix).
PACK_MARKS = ("comfyui-toma", "toma_stats", "toma.stats", "[toma stats]")


@dataclass(frozen=True)
class ConsoleEntry:
    """One console message, page exception or browser log entry."""

    source: str  # "console", "exception", or Log.entryAdded's source ("network", ...)
    level: str
    text: str
    url: str = ""

    def mentions_pack(self) -> bool:
        blob = f"{self.text} {self.url}".lower()
        return any(mark in blob for mark in PACK_MARKS)


# Files the frontend asks for in every fresh user directory and copes without (404).
OPTIONAL_USER_FILES = re.compile(
    r"^/(favicon\.ico|user\.css|api/userdata|api/userdata/(user\.css|comfy\.templates\.json))$")


def unavoidable_reason(entry: ConsoleEntry, origin: str) -> str | None:
    """Why an error is none of the pack's business, or None if it may be.

    Each rule was checked against the same ComfyUI without the pack, where it shows up the
    same way. Anything naming the pack's files or event is never excused.
    """
    if entry.mentions_pack():
        return None
    if entry.source == "network":
        url = urllib.parse.urlsplit(entry.url)
        if f"{url.scheme}://{url.netloc}" != origin:
            return "external request (update check, node docs): the test machine is offline"
        if "404" in entry.text and OPTIONAL_USER_FILES.match(url.path):
            return "optional file absent from the fresh user directory"
    if (entry.source == "exception" and "addSetting" in entry.text
            and "reading 'id'" in entry.text):
        return "frontend 1.27 bug: a core setting's onChange runs before extensions load"
    if entry.text == "ComfyApp graph accessed before initialization":
        return "frontend 1.49 core reads app.rootGraph during startup"
    return None


@dataclass
class PageRecord:
    """What the page reported during the session."""

    origin: str
    extensions: list[str] = field(default_factory=list)
    toma_nodes: list[dict[str, Any]] = field(default_factory=list)
    simulated_text: str | None = None
    real_text: str | None = None
    real_run: comfy_server.PromptRun | None = None
    console: list[ConsoleEntry] = field(default_factory=list)

    def errors(self) -> list[tuple[ConsoleEntry, str | None]]:
        """Every error with the reason it is unavoidable (None: unexplained)."""
        return [(entry, unavoidable_reason(entry, self.origin))
                for entry in self.console if entry.level == "error"]

    def pack_complaints(self) -> list[ConsoleEntry]:
        # web/toma_stats.js reports what it catches with console.warn("[ToMA stats]", ...);
        # the frontend warns about message types nobody listens to ("toma.stats").
        return [entry for entry in self.console
                if entry.mentions_pack() and entry.level in ("warning", "error")]


# Chromium ------------------------------------------------------------------------------------
def find_chromium() -> str | None:
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


@contextlib.contextmanager
def running_chromium(executable: str, profile: Path) -> Iterator[int]:
    """Headless Chromium with DevTools on a port it picks itself; yields that port."""
    command = [executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--window-size=1280,900",
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

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


# The browser session ---------------------------------------------------------------------------
async def _page_socket_url(session: aiohttp.ClientSession, port: int) -> str:
    async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
        targets = await response.json(content_type=None)
    pages = [t for t in targets if t.get("type") == "page"]
    assert pages, f"no page target in {targets}"
    return pages[0]["webSocketDebuggerUrl"]


async def _browse(server: ComfyServer, port: int) -> PageRecord:
    record = PageRecord(origin=server.url)
    async with aiohttp.ClientSession() as session:
        ws_url = await _page_socket_url(session, port)
        async with session.ws_connect(ws_url, max_msg_size=0) as ws:
            cdp = Cdp(ws)
            try:
                await _drive_page(cdp, server, record)
            finally:
                record.console = list(cdp.console)
                await cdp.close()
                for entry in record.console:  # also when the session failed half-way
                    log.debug("page console [%s/%s] %s %s", entry.source, entry.level,
                              entry.text, entry.url)
    return record


async def _drive_page(cdp: Cdp, server: ComfyServer, record: PageRecord) -> None:
    for domain in ("Runtime", "Log", "Page"):
        await cdp.call(f"{domain}.enable")
    await cdp.call("Page.navigate", url=server.url + "/")
    await cdp.wait_for(JS_READY, UI_TIMEOUT_S, "the ComfyUI app with the ToMA node registered")
    record.extensions = await cdp.evaluate(JS_EXTENSIONS)

    await cdp.evaluate(f"{JS_APP}.loadGraphData({WORKFLOW.read_text()}).then(() => true)")
    record.toma_nodes = await cdp.evaluate(JS_TOMA_NODES)
    if record.toma_nodes:
        # Node ids are numbers up to frontend 1.35 and strings in 1.49; the backend sends
        # strings, and getNodeById takes either.
        node_id = str(record.toma_nodes[0]["id"])
        record.simulated_text = await _simulated_stats(cdp, node_id)
        record.real_run, record.real_text = await _real_stats(cdp, server, node_id)


async def _simulated_stats(cdp: Cdp, node_id: str) -> str | None:
    """Deliver a message as the backend would send it, straight to the api's listeners."""
    detail = json.dumps({"node": node_id, "stats": SIMULATED_STATS})
    await cdp.evaluate(
        f'{JS_API}.dispatchEvent(new CustomEvent("toma.stats", {{detail: {detail}}}))')
    return await cdp.evaluate(_node_text(node_id))


async def _real_stats(cdp: Cdp, server: ComfyServer,
                      node_id: str) -> tuple[comfy_server.PromptRun, str]:
    """Queue a run whose ToMA node has the page's ToMA node's id: ComfyUI broadcasts the
    stats to every socket, this page's included."""
    await cdp.evaluate(f"delete {JS_APP}.graph.getNodeById({json.dumps(node_id)}).toma_stats")
    inputs = {**comfy_server.node_defaults(toma_pack.NODE_CLASS_MAPPINGS["ToMA"]), "ratio": 0.5}
    graph = comfy_server.tiny_sdxl_graph(node_id, inputs)
    run = await asyncio.to_thread(comfy_server.run_prompt, server, graph)
    text = await cdp.wait_for(_node_text(node_id), STATS_TIMEOUT_S, "real stats on the node")
    return run, text


# Fixtures and tests ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chromium() -> str:
    executable = find_chromium()
    if executable is None:
        pytest.skip("no Chromium found (Debian: apt-get install chromium)")
    return executable


@pytest.fixture(scope="module")
def server(comfyui_path: Path, tmp_path_factory: pytest.TempPathFactory,
           chromium: str) -> Iterator[ComfyServer]:
    # Takes `chromium` so that no server starts when the browser is missing.
    with comfy_server.running_server(comfyui_path, tmp_path_factory.mktemp("server")) as running:
        status, body = running.get("/")
        if status != 200 or b"<html" not in body.lower():
            pytest.skip(f"this ComfyUI serves no frontend at / (HTTP {status}); install its "
                        "comfyui-frontend-package")
        yield running


@pytest.fixture(scope="module")
def page(server: ComfyServer, chromium: str,
         tmp_path_factory: pytest.TempPathFactory) -> PageRecord:
    profile = tmp_path_factory.mktemp("chromium") / "profile"
    with running_chromium(chromium, profile) as port:
        return asyncio.run(_browse(server, port))


def test_extension_registers(page: PageRecord) -> None:
    assert EXTENSION_NAME in page.extensions, page.extensions


def test_workflow_loads_with_toma_widgets(page: PageRecord) -> None:
    workflow = json.loads(WORKFLOW.read_text())
    expected = {str(node["id"]): node["widgets_values"] for node in workflow["nodes"]
                if node["type"] == "ToMA"}
    loaded = {str(node["id"]): [value for _, value in node["widgets"]]
              for node in page.toma_nodes}
    assert loaded == expected
    required = toma_pack.NODE_CLASS_MAPPINGS["ToMA"].INPUT_TYPES()["required"]
    widget_inputs = [name for name, spec in required.items()
                     if isinstance(spec[0], (list, tuple)) or spec[0] in WIDGET_TYPES]
    assert [name for name, _ in page.toma_nodes[0]["widgets"]] == widget_inputs


def test_simulated_stats_reach_the_node(page: PageRecord) -> None:
    assert page.simulated_text == SIMULATED_TEXT


def test_real_stats_reach_the_node(page: PageRecord) -> None:
    assert page.real_run is not None
    assert page.real_run.history["status"]["status_str"] == "success"
    # Ratio 0.5, some of the tiny SDXL's layers merged, both sampling steps.
    assert page.real_text is not None
    assert re.match(r"50% merged · [1-9]\d*/\d+ layers · 2/2 steps", page.real_text), \
        page.real_text


def test_no_console_errors(page: PageRecord) -> None:
    assert not page.pack_complaints(), page.pack_complaints()
    errors = page.errors()
    for entry, reason in errors:
        if reason is not None:
            log.info("ignored console error (%s): %s %s", reason, entry.text[:200], entry.url)
    unexplained = [entry for entry, reason in errors if reason is None]
    assert not unexplained, unexplained
