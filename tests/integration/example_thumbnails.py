"""Make the template browser's thumbnail of every example workflow: example_workflows/<name>.jpg.

ComfyUI's template browser shows a custom node pack's example `<name>.json` under the title
`<name>` with the picture `<name>.jpg` from the same folder. The picture made here is the
workflow itself as ComfyUI's frontend draws it: the ToMA node and the nodes linked to it, in a
square. Run it after adding or changing an example (it needs Chromium and a ComfyUI with its
frontend, like the frontend test):

    COMFYUI_PATH=../shared/comfyui/v0.33.0 PYTHONPATH=../shared/stubs \\
        .venv/bin/python tests/integration/example_thumbnails.py [name.json ...]

tests/unit/test_example_workflows.py checks that every example has one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import browser
import comfy_server
from browser import JS_APP, Cdp

SIDE = 768          # thumbnail size in pixels (the frontend shows it square, cropped to fit)
MARGIN = 40         # graph units around the nodes shown
MAX_SCALE = 1.0     # never magnify: a blurry node is worse than some empty canvas
JPEG_QUALITY = 85
WINDOW = (1280, 1000)  # room for the square below the frontend's menus
TOMA_TYPES = ("ToMA", "ToMAAdvanced")

log = logging.getLogger("example_thumbnails")

# Graph units of the ToMA nodes and every node linked to one, as [x0, y0, x1, y1].
JS_BOUNDS = f"""(() => {{
  const graph = {JS_APP}.graph;
  const toma = graph._nodes.filter((n) => {json.dumps(TOMA_TYPES)}.includes(n.type));
  const shown = new Set(toma);
  for (const node of toma) {{
    for (const input of node.inputs ?? []) {{
      const link = input.link != null ? graph.links[input.link] ?? graph.links.get?.(input.link)
                                      : null;
      if (link) shown.add(graph.getNodeById(link.origin_id));
    }}
    for (const output of node.outputs ?? []) {{
      for (const id of output.links ?? []) {{
        const link = graph.links[id] ?? graph.links.get?.(id);
        if (link) shown.add(graph.getNodeById(link.target_id));
      }}
    }}
  }}
  const title = globalThis.LiteGraph.NODE_TITLE_HEIGHT;
  const nodes = [...shown].filter(Boolean);
  return [Math.min(...nodes.map((n) => n.pos[0])),
          Math.min(...nodes.map((n) => n.pos[1] - title)),
          Math.max(...nodes.map((n) => n.pos[0] + n.size[0])),
          Math.max(...nodes.map((n) => n.pos[1] + n.size[1]))];
}})()"""


async def _frame_nodes(cdp: Cdp) -> dict[str, float]:
    """Zoom and pan so that the ToMA node and its neighbours fill a SIDE x SIDE square in the
    middle of the canvas; that square's clip."""
    x0, y0, x1, y1 = await cdp.evaluate(JS_BOUNDS)
    width, height = x1 - x0 + 2 * MARGIN, y1 - y0 + 2 * MARGIN
    scale = min(SIDE / width, SIDE / height, MAX_SCALE)
    # Graph point (cx, cy), the centre of the nodes, goes to the centre of the canvas.
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    box = await cdp.evaluate(f"""(() => {{
      const canvas = {JS_APP}.canvas;
      const box = canvas.canvas.getBoundingClientRect();
      canvas.ds.scale = {scale};
      canvas.ds.offset[0] = box.width / 2 / {scale} - {cx};
      canvas.ds.offset[1] = box.height / 2 / {scale} - {cy};
      canvas.setDirty(true, true);
      return {{x: box.x, y: box.y, width: box.width, height: box.height}};
    }})()""")
    await cdp.frames(3)
    assert min(box["width"], box["height"]) >= SIDE, f"canvas {box} is smaller than {SIDE} px"
    return {"x": box["x"] + (box["width"] - SIDE) / 2, "y": box["y"] + (box["height"] - SIDE) / 2,
            "width": SIDE, "height": SIDE}


async def _shoot(port: int, server: comfy_server.ComfyServer, examples: list[Path]) -> None:
    async with browser.comfy_page(port, server.url + "/", 120.0) as cdp:
        # Menus and side bars out of the way; node text drawn at any zoom.
        await cdp.evaluate(f"{JS_APP}.extensionManager.command.execute("
                           "'Workspace.ToggleFocusMode').then(() => true)")
        await cdp.evaluate(f"{JS_APP}.extensionManager.setting.set("
                           "'LiteGraph.Canvas.MinFontSizeForLOD', 1).then(() => true)")
        for path in examples:
            await browser.load_workflow(cdp, json.loads(path.read_text()))
            # This server has no model files: the frontend outlines the loaders in red. The
            # user's ComfyUI has them.
            await cdp.evaluate(f"{JS_APP}.graph._nodes.forEach((n) => {{ n.has_errors = false; }})"
                               " || true")
            clip = await _frame_nodes(cdp)
            target = path.with_suffix(".jpg")
            target.write_bytes(await cdp.screenshot(clip, fmt="jpeg", quality=JPEG_QUALITY))
            log.info("wrote %s", target)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="example file names (default: all)")
    args = parser.parse_args()
    folder = comfy_server.REPO_ROOT / "example_workflows"
    examples = [folder / name for name in args.names] or sorted(folder.glob("*.json"))
    comfyui = Path(os.environ.get("COMFYUI_PATH", ""))
    if not (comfyui / "main.py").is_file():
        sys.exit("set COMFYUI_PATH to a ComfyUI checkout whose requirements this Python has")
    chromium = browser.find_chromium()
    if chromium is None:
        sys.exit("no Chromium found (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        with comfy_server.running_server(comfyui, root) as server, \
                browser.running_chromium(chromium, root / "profile", WINDOW) as port:
            asyncio.run(_shoot(port, server, examples))


if __name__ == "__main__":
    main()
