"""Save, in ComfyUI's real frontend, a workflow that sets every widget of the pack's nodes.

Saved workflows store widget values by position, so a workflow saved today must still put each
value into the same input after any change to the nodes. This script builds, in the frontend
of the ComfyUI under test, a graph with one ToMA, ToMAAdvanced and ToMAPreview node each, with
every widget set away from its default (VALUES), runs it once (so the frontend also holds the
stats text the nodes show after a run, which frontend 1.35 saves after the widget values) and
saves what the frontend saves (`graph.serialize()`) to

    tests/integration/saved_workflows/frontend-<version>.json

tests/integration/test_frontend.py loads these files in every frontend at least as new as the
one that saved them, and checks the values the nodes' code receives when they run. The files
committed there were saved with the pack's V1 nodes (INPUT_TYPES), before the V3 port, in
frontends 1.27.10, 1.35.9 and 1.49.6 (ComfyUI v0.3.64, v0.8.0 and v0.33.0):

    COMFYUI_PATH=../shared/comfyui/v0.33.0 PYTHONPATH=../shared/stubs \\
        .venv/bin/python tests/integration/saved_workflows.py
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import browser
import comfy_server
from browser import JS_APP, Cdp

log = logging.getLogger("saved_workflows")

FOLDER = Path(__file__).resolve().parent / "saved_workflows"
STATS_TIMEOUT_S = 60.0
TEXT_WIDGET = "$$node-text-preview"  # the frontend's widget for a node's progress text

# Widget values, none of them a default, no two alike where a swap could go unnoticed.
VALUES: dict[str, dict[str, Any]] = {
    "ToMA": {"ratio": 0.25, "tile_count": 4, "skip_blocks": "none", "recompute_every": 2},
    "ToMAAdvanced": {
        "ratio": 0.35, "tile_count": 16, "skip_blocks": "d1-3, s2", "recompute_every": 3,
        "start_percent": 0.1, "end_percent": 0.9, "unet_levels": "all",
        "merge_scope": "attention", "region": "stripe", "tau": 500.0, "unmerge": "pinv",
        "batch_policy": "shared", "verbose": True},
    "ToMAPreview": {"ratio": 0.3, "tile_count": 9, "level": "32px (SDXL inner)"},
}
# The other nodes' widgets: a small, quick run of the test nodes (server_nodes/).
SOURCE = {"latent_size": 64, "seed": 0}
SAMPLER = {"seed": 0, "steps": 2, "cfg": 2.0, "sampler_name": "euler", "scheduler": "normal",
           "denoise": 1.0}
SEED_CONTROL = "fixed"  # KSampler's "control after generate": the seed stays as saved
PICTURE = {"width": 256, "height": 192}

# Builds the graph; returns the ids of the pack's nodes by type.
JS_BUILD = f"""(() => {{
  const app = {JS_APP}, graph = app.graph, LiteGraph = globalThis.LiteGraph;
  const values = {json.dumps(VALUES)};
  graph.clear();
  const add = (type, x, y, widgets) => {{
    const node = LiteGraph.createNode(type);
    node.pos = [x, y];
    graph.add(node);
    for (const [name, value] of Object.entries(widgets ?? {{}})) {{
      const widget = node.widgets.find((w) => w.name === name);
      if (!widget) throw new Error(`${{type}} has no widget ${{name}}`);
      widget.value = value;
      widget.callback?.(value);
    }}
    return node;
  }};
  const source = add("ToMATestTinySDXL", 40, 80, {json.dumps(SOURCE)});
  const ids = {{}};
  ["ToMA", "ToMAAdvanced"].forEach((type, row) => {{
    const toma = add(type, 420, 60 + row * 420, values[type]);
    const sampler = add("KSampler", 820, 60 + row * 420, {json.dumps(SAMPLER)});
    const control = sampler.widgets.find((w) => w.name === "control_after_generate");
    if (control) control.value = {json.dumps(SEED_CONTROL)};
    const sink = add("ToMATestLatentSink", 1200, 60 + row * 420);
    source.connect(0, toma, 0);
    toma.connect(0, sampler, 0);
    source.connect(1, sampler, 1);
    source.connect(2, sampler, 2);
    source.connect(3, sampler, 3);
    sampler.connect(0, sink, 0);
    ids[type] = String(toma.id);
  }});
  const picture = add("ToMATestImage", 40, 900, {json.dumps(PICTURE)});
  const preview = add("ToMAPreview", 420, 900, values.ToMAPreview);
  const sink = add("ToMATestImageSink", 820, 900);
  picture.connect(0, preview, 0);
  preview.connect(0, sink, 0);
  ids.ToMAPreview = String(preview.id);
  graph.setDirtyCanvas(true, true);
  return ids;
}})()"""


def js_text(node_id: str) -> str:
    """The progress text a node shows, or null."""
    return (f"({JS_APP}.graph.getNodeById({json.dumps(node_id)})?.widgets ?? []).find("
            f"(w) => w.name === {json.dumps(TEXT_WIDGET)})?.value || null")


async def api_prompt(cdp: Cdp) -> dict[str, Any]:
    """The API-format graph the frontend queues for what it shows (its graphToPrompt)."""
    return await cdp.evaluate(f"{JS_APP}.graphToPrompt().then((p) => p.output)")


def frontend_version() -> str:
    """The comfyui-frontend-package this Python serves, e.g. "1.27.10"."""
    return importlib.metadata.version("comfyui-frontend-package")


async def _save(port: int, server: comfy_server.ComfyServer) -> Path:
    async with browser.comfy_page(port, server.url + "/", 120.0) as cdp:
        ids = await cdp.evaluate(JS_BUILD)
        await cdp.frames(3)
        graph = await api_prompt(cdp)
        run = await asyncio.to_thread(comfy_server.run_prompt, server, graph)
        status = run.history["status"]
        assert status["status_str"] == "success", status
        for node_type in ("ToMA", "ToMAAdvanced"):
            await cdp.wait_for(js_text(ids[node_type]), STATS_TIMEOUT_S,
                               f"the stats on the {node_type} node")
        await cdp.frames(3)
        workflow = await cdp.evaluate(f"{JS_APP}.graph.serialize()")
    FOLDER.mkdir(exist_ok=True)
    target = FOLDER / f"frontend-{frontend_version()}.json"
    target.write_text(json.dumps(workflow, indent=1, ensure_ascii=False) + "\n")
    return target


def main() -> None:
    """Save the workflow from the ComfyUI at $COMFYUI_PATH (see the module docstring)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    comfyui = Path(os.environ.get("COMFYUI_PATH", ""))
    if not (comfyui / "main.py").is_file():
        sys.exit("set COMFYUI_PATH to a ComfyUI checkout whose requirements this Python has")
    chromium = browser.find_chromium()
    if chromium is None:
        sys.exit("no Chromium found (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        with comfy_server.running_server(comfyui, root) as server, \
                browser.running_chromium(chromium, root / "profile") as port:
            log.info("wrote %s", asyncio.run(_save(port, server)))


if __name__ == "__main__":
    main()
