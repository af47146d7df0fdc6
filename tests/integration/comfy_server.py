"""Run ComfyUI's own main.py, with this pack installed, for the server and frontend tests.

Nothing is written into the ComfyUI checkout: every run gets a temporary base directory
(`--base-directory`, in 0.3.64, 0.8.0 and 0.33.0) whose custom_nodes/ holds symlinks to this
repository (as "ComfyUI-ToMA", the name users clone it under) and to the test-only node pack
in server_nodes/; ComfyUI puts its output, input, temp and user folders there too, and the
database (`--database-url`, default inside the checkout) goes there as well.

Also here: the API-format graph both tests queue (test tiny SDXL -> ToMA -> KSampler -> sink)
and `run_prompt`, which queues it and follows it over the websocket and /history.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
TEST_NODES = Path(__file__).resolve().parent / "server_nodes"
PACK_FOLDER = "ComfyUI-ToMA"
TEST_PACK_FOLDER = "toma_test_nodes"
# Waits that guard against a hang, not speed targets: generous enough for a machine loaded
# several times over (a 2-core CI machine running two suites and other jobs).
STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
PROMPT_TIMEOUT_S = 900.0
LOG_TAIL_CHARS = 4000

# A user who has seen the frontend before, and whose browser may reload a page with unsaved
# workflows (the confirmation dialog would block a headless page).
FRONTEND_SETTINGS = {"Comfy.TutorialCompleted": True, "Comfy.Window.UnloadConfirmation": False}

# "   0.1 seconds (IMPORT FAILED): /tmp/.../custom_nodes/ComfyUI-ToMA" in all versions; 0.33
# puts a coloured "[INFO]" before it.
_IMPORT_LINE = re.compile(r"\s[\d.]+ seconds(?P<failed> \(IMPORT FAILED\))?: (?P<path>\S.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class ServerError(RuntimeError):
    """ComfyUI did not start or stopped unexpectedly; the message ends with its log."""


def make_base_directory(root: Path) -> Path:
    """A ComfyUI base directory under `root` with this pack and the test nodes installed, and
    a user who has seen the frontend before (a first visit opens the template browser over
    the canvas in frontends 1.35 and 1.49)."""
    base = root / "comfy_base"
    custom_nodes = base / "custom_nodes"
    custom_nodes.mkdir(parents=True)
    (custom_nodes / PACK_FOLDER).symlink_to(REPO_ROOT, target_is_directory=True)
    (custom_nodes / TEST_PACK_FOLDER).symlink_to(TEST_NODES, target_is_directory=True)
    settings = base / "user" / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True)
    settings.write_text(json.dumps(FRONTEND_SETTINGS))
    return base


def comfy_command(comfyui: Path, base: Path, *extra: str) -> list[str]:
    """main.py in this Python, CPU only, everything it writes kept under `base`."""
    return [sys.executable, str(comfyui / "main.py"), "--cpu",
            "--base-directory", str(base),
            "--database-url", f"sqlite:///{base / 'comfyui.db'}",
            "--disable-auto-launch", *extra]


def comfy_env(comfyui: Path) -> dict[str, str]:
    """The environment for main.py: this one (PYTHONPATH with any stubs), plus what the test
    nodes' harness needs to find ComfyUI, unbuffered output so the log is complete when read,
    and no bytecode written into the checkout."""
    env = dict(os.environ)
    env.update(COMFYUI_PATH=str(comfyui), PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def tail(text: str) -> str:
    return text[-LOG_TAIL_CHARS:]


def run_quick_test(comfyui: Path, base: Path, timeout: float) -> subprocess.CompletedProcess:
    """`main.py --quick-test-for-ci`: imports core and every node pack, then exits."""
    return subprocess.run(
        comfy_command(comfyui, base, "--quick-test-for-ci"), cwd=base, env=comfy_env(comfyui),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
        check=False)


def custom_node_imports(log_text: str) -> dict[str, bool]:
    """Custom node folder name -> imported fine, from ComfyUI's "Import times" report."""
    imports: dict[str, bool] = {}
    for line in _ANSI.sub("", log_text).splitlines():
        match = _IMPORT_LINE.search(line)
        if match:
            imports[Path(match["path"].strip()).name] = match["failed"] is None
    return imports


def free_port() -> int:
    # The OS picks a free port; the short race until ComfyUI binds it is acceptable in tests.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ComfyServer:
    """A running ComfyUI server and where its log goes."""

    comfyui: Path
    base: Path
    port: int
    process: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, timeout: float = 30.0) -> tuple[int, bytes]:
        """(HTTP status, body) of GET `path`; error statuses are returned, not raised."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def get_json(self, path: str, timeout: float = 30.0) -> Any:
        status, body = self.get(path, timeout)
        if status != 200:
            raise AssertionError(f"GET {path}: HTTP {status}: {body[:500]!r}")
        return json.loads(body)

    def post(self, path: str, payload: Any, timeout: float = 30.0) -> tuple[int, Any]:
        """(HTTP status, decoded JSON body) of POST `path`; error statuses are returned."""
        request = urllib.request.Request(
            self.url + path, data=json.dumps(payload).encode(), method="POST",
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise ServerError(f"ComfyUI exited with code {self.process.returncode}:\n"
                              f"{tail(self.log_text())}")


def _wait_until_ready(server: ComfyServer, timeout: float) -> None:
    # /system_stats answers once the routes are up, which is after every node pack imported.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        server.check_alive()
        try:
            if server.get("/system_stats", timeout=5.0)[0] == 200:
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.5)
    raise ServerError(f"ComfyUI did not answer within {timeout:.0f} s:\n{tail(server.log_text())}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("ComfyUI ignored SIGTERM for %.0f s: killing it", STOP_TIMEOUT_S)
        process.kill()
        process.wait(STOP_TIMEOUT_S)


@contextlib.contextmanager
def running_server(comfyui: Path, root: Path, startup_timeout: float = STARTUP_TIMEOUT_S,
                   base: Path | None = None) -> Iterator[ComfyServer]:
    """A ComfyUI server on 127.0.0.1, stopped (and killed if need be) on exit. Its base
    directory is `base`, else a new one under `root` with this pack and the test nodes (see
    make_base_directory); the log goes to `root`."""
    base = base or make_base_directory(root)
    port = free_port()
    log_path = root / "comfyui.log"
    command = comfy_command(comfyui, base, "--listen", "127.0.0.1", "--port", str(port))
    log.info("starting ComfyUI: %s", " ".join(command))
    with log_path.open("w") as log_file:
        # The log goes to a file, not a pipe: nobody drains a pipe while tests run, and a full
        # pipe would block the server.
        process = subprocess.Popen(command, cwd=base, env=comfy_env(comfyui),
                                   stdout=log_file, stderr=subprocess.STDOUT)
    server = ComfyServer(comfyui, base, port, process, log_path)
    try:
        _wait_until_ready(server, startup_timeout)
        yield server
    finally:
        _stop(process)


# Running a graph ------------------------------------------------------------------------------
SOURCE_ID, SAMPLER_ID, SINK_ID = "100", "101", "102"
LATENT_SIZE = 64  # the outer attention level of the tiny SDXL has 1024 tokens: ToMA merges
PROGRESS_TEXT_EVENT = 3
_DONE_EVENTS = ("execution_success", "execution_error", "execution_interrupted")


def tiny_sdxl_graph(toma_id: str, toma_inputs: dict[str, Any], seed: int = 0,
                    toma_type: str = "ToMA", source_seed: int = 0) -> dict[str, dict]:
    """API-format graph: test tiny SDXL -> ToMA (node `toma_id`) -> KSampler (2 steps) -> sink.

    `toma_inputs` are the widget values of the ToMA node (of type `toma_type`: ToMA or
    ToMAAdvanced); the model link is added here. `seed` is the sampler's, `source_seed` the
    tiny model's (ComfyUI answers a prompt identical to an earlier one from its cache, and
    reuses a node's output while its inputs and those upstream stay the same).
    """
    def link(node: str, output: int) -> list:
        return [node, output]

    return {
        SOURCE_ID: {"class_type": "ToMATestTinySDXL",
                    "inputs": {"latent_size": LATENT_SIZE, "seed": source_seed}},
        toma_id: {"class_type": toma_type,
                  "inputs": {**toma_inputs, "model": link(SOURCE_ID, 0)}},
        SAMPLER_ID: {"class_type": "KSampler", "inputs": {
            "model": link(toma_id, 0), "seed": seed, "steps": 2, "cfg": 2.0,
            "sampler_name": "euler", "scheduler": "normal", "positive": link(SOURCE_ID, 1),
            "negative": link(SOURCE_ID, 2), "latent_image": link(SOURCE_ID, 3), "denoise": 1.0}},
        SINK_ID: {"class_type": "ToMATestLatentSink",
                  "inputs": {"samples": link(SAMPLER_ID, 0)}},
    }


def speed_check_graph(check_id: str, check_inputs: dict[str, Any], toma_inputs: dict[str, Any],
                      toma_id: str = "103", source_seed: int = 0) -> dict[str, dict]:
    """API-format graph: test tiny SDXL -> ToMA (node `toma_id`, widgets `toma_inputs`) -> ToMA
    Speed Check (node `check_id`, widgets `check_inputs`) -> image sink."""
    graph = tiny_sdxl_graph(toma_id, toma_inputs, source_seed=source_seed)
    del graph[SAMPLER_ID]
    graph[check_id] = {"class_type": "ToMASpeedCheck", "inputs": {
        **check_inputs, "model": [toma_id, 0], "positive": [SOURCE_ID, 1],
        "latent": [SOURCE_ID, 3]}}
    graph[SINK_ID] = {"class_type": "ToMATestImageSink", "inputs": {"images": [check_id, 0]}}
    return graph


def recorded_calls(server: ComfyServer, prompt_id: str) -> list[dict[str, Any]]:
    """The runs of the pack's nodes in a prompt, as the test nodes recorded them: node id,
    node type and the inputs the node's execute received (see server_nodes/)."""
    return server.get_json(f"/toma_test/calls?prompt_id={prompt_id}")


@dataclass
class PromptRun:
    """A finished prompt: its id, its /history entry and every websocket message seen (binary
    progress-text frames as {"type": "progress_text", "data": {"node", "text"}}; previews,
    the other binary frames, are left out)."""

    prompt_id: str
    history: dict[str, Any]
    messages: list[dict[str, Any]]

    def messages_of(self, kind: str) -> list[dict[str, Any]]:
        return [m.get("data") or {} for m in self.messages if m.get("type") == kind]


def _is_done(message: dict[str, Any], prompt_id: str) -> bool:
    data = message.get("data") or {}
    if data.get("prompt_id") != prompt_id:
        return False
    kind = message.get("type")
    # "executing" with no node is the end marker in every version; the others end it early.
    return kind in _DONE_EVENTS or (kind == "executing" and data.get("node") is None)


async def _submit_and_listen(server: ComfyServer, graph: dict[str, dict],
                             timeout: float) -> tuple[str, list[dict[str, Any]]]:
    import aiohttp  # ComfyUI's own dependency: present wherever a ComfyUI server runs

    client_id = uuid.uuid4().hex
    messages: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as session:
        # Connect first: ComfyUI broadcasts to the sockets open when a message is sent.
        async with session.ws_connect(f"{server.url}/ws?clientId={client_id}") as ws:
            async with session.post(f"{server.url}/prompt",
                                    json={"prompt": graph, "client_id": client_id}) as response:
                body = await response.json(content_type=None)
                if response.status != 200:
                    raise AssertionError(f"POST /prompt: HTTP {response.status}: {body}")
            prompt_id = str(body["prompt_id"])
            await asyncio.wait_for(_listen(ws, prompt_id, messages), timeout)
    return prompt_id, messages


async def _listen(ws: Any, prompt_id: str, messages: list[dict[str, Any]]) -> None:
    import aiohttp

    async for frame in ws:
        if frame.type == aiohttp.WSMsgType.BINARY:
            text = progress_text(frame.data)
            if text is not None:
                messages.append({"type": "progress_text", "data": text})
        elif frame.type == aiohttp.WSMsgType.TEXT:
            messages.append(json.loads(frame.data))
            if _is_done(messages[-1], prompt_id):
                return
    raise AssertionError(f"websocket closed before prompt {prompt_id} ended")


def progress_text(frame: bytes) -> dict[str, str] | None:
    """{"node", "text"} of a binary progress-text frame, None for other binary frames.

    The layout PromptServer.send_progress_text gives it in 0.3.64 to 0.33.0: event type 3
    (protocol.BinaryEventTypes.TEXT) as a big-endian uint32, the node id's length as another,
    the node id, then the text, both UTF-8.
    """
    if len(frame) < 8 or struct.unpack(">I", frame[:4])[0] != PROGRESS_TEXT_EVENT:
        return None
    (length,) = struct.unpack(">I", frame[4:8])
    return {"node": frame[8:8 + length].decode(), "text": frame[8 + length:].decode()}


def _wait_for_history(server: ComfyServer, prompt_id: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        server.check_alive()
        history = server.get_json(f"/history/{prompt_id}")
        entry = history.get(prompt_id)
        if entry and (entry.get("status") or {}).get("completed") is not None:
            return entry
        time.sleep(0.25)
    raise AssertionError(f"prompt {prompt_id} not in /history after {timeout:.0f} s:\n"
                         f"{tail(server.log_text())}")


def run_prompt(server: ComfyServer, graph: dict[str, dict],
               timeout: float = PROMPT_TIMEOUT_S) -> PromptRun:
    """POST `graph` to /prompt, collect the websocket messages until it ends, then poll
    /history/<prompt_id> until the run is recorded there."""
    started = time.monotonic()
    try:
        prompt_id, messages = asyncio.run(_submit_and_listen(server, graph, timeout))
    except asyncio.TimeoutError as exc:  # not yet the builtin TimeoutError in Python 3.10
        server.check_alive()
        raise AssertionError(f"prompt did not finish within {timeout:.0f} s (it had run "
                             f"{time.monotonic() - started:.0f} s since it was queued):\n"
                             f"{tail(server.log_text())}") from exc
    return PromptRun(prompt_id, _wait_for_history(server, prompt_id, timeout), messages)
