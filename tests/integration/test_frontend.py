"""What a person sees in ComfyUI's real frontend, in headless Chromium.

One browser session per module (the frontend takes a while to load) against a real ComfyUI
(comfy_server.py). It opens the SDXL example, queues a real run whose ToMA node has the page's
ToMA node's id (ComfyUI broadcasts the node's progress text to every socket, this page's
included) and looks at the node:

- classic canvas: by pixels. Screenshots before and after the stats arrive differ on the node,
  and the text itself is painted: blanking just the text changes many pixels where it was.
- Nodes 2.0 (Vue nodes): in the DOM. The node's element shows the text, unhidden and on top.

Then it opens the template browser and checks the examples' titles and thumbnails there.
An example that needs a later ComfyUI than this one (tests/example_gate.py) is listed there but
not opened: its nodes must be missing here instead.

Saved workflows keep widget values by position: every example and every workflow saved with the
pack's V1 nodes in frontends 1.27, 1.35 and 1.49 (saved_workflows/, see saved_workflows.py; each
in every frontend, older ones included) is opened here, queued as the frontend queues it, and
run; the inputs the nodes' V3 `execute` received (recorded by the test nodes) must be the values
that were saved, each in its input.

Help pages: for each node, in English and in Chinese (Comfy.Locale zh, page reloaded), the
test puts the node on an empty canvas, selects it with a mouse click and clicks the selection
toolbox's info button (frontends 1.27 to 1.49), then finds the node's help page (web/docs/),
its picture and the translated names (locales/zh/) in the page.

The screenshots are kept (TOMA_SCREENSHOT_DIR, else pytest's temporary directory; the log says
where) so that a person can look at them.

Skipped without Chromium (Debian: `apt-get install chromium`) or when the ComfyUI under test
does not serve its frontend (the comfyui-frontend-package pip package).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import io
import json
import logging
import os
import re
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

import browser
import comfy_harness as ch
import comfy_server
import example_gate
import saved_workflows
from browser import JS_APP, Cdp, ConsoleEntry
from comfy_server import ComfyServer
from toma_pack.nodes import NODE_SPECS

log = logging.getLogger(__name__)

EXAMPLES = comfy_server.REPO_ROOT / "example_workflows"
WORKFLOW = EXAMPLES / "SDXL text to image.json"
CATEGORY_TITLE = "ToMA Token Merge"  # locales/en/main.json, templateWorkflows.category
# Waits that guard against a hang, not speed targets (see comfy_server's)
UI_TIMEOUT_S = 600.0
STATS_TIMEOUT_S = 120.0
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")  # plus combos (option lists)
TEXT_WIDGET = "$$node-text-preview"  # the frontend's widget for a node's progress text
STATS_LINE = re.compile(r"50% merged · [1-9]\d*/\d+ layers · 2/2 steps")
# A pixel "changed" when a colour channel moved by more than this (JPEG-free PNGs: only real
# drawing changes pixels; antialiasing noise between identical frames is 0).
PIXEL_DELTA = 24
# Pixels the stats text paints (stats vs. the same frame with the text blanked): measured 1357,
# 1423 and 1486 on frontends 1.27, 1.35 and 1.49 (the two lines the canvas's text box shows);
# an empty box paints none. A third of the smallest, so that a font change does not trip it.
MIN_TEXT_PIXELS = 450
SPEED_CHECK_ROW = "ToMA 0.5 (connected)"   # the speed check's row for the ToMA node before it


def _frontend_version() -> tuple[int, ...]:
    """The comfyui-frontend-package this Python has (ComfyUI serves it), (0,) without one."""
    try:
        return tuple(int(part) for part in
                     importlib.metadata.version("comfyui-frontend-package").split(".")[:2])
    except importlib.metadata.PackageNotFoundError:
        return (0,)


# Frontend 1.27 (ComfyUI 0.3.64) has only an experimental "Vue nodes" mode, which does not show
# progress text at all; Nodes 2.0 is checked from 1.35 (ComfyUI 0.8.0) on.
NODES_2_SINCE = (1, 35)
RENDER_MODES = ("canvas", "nodes_2") if _frontend_version() >= NODES_2_SINCE else ("canvas",)

PACK_TYPES = tuple(NODE_SPECS)
TOMA_TYPES = ("ToMA", "ToMAAdvanced")
# What the recording shows for the inputs that come through links.
LINKED_INPUTS = {"model": "ModelPatcher", "image": "Tensor"}
SAVED = sorted(saved_workflows.FOLDER.glob("frontend-*.json"))
DOCS = comfy_server.REPO_ROOT / "web" / "docs"
LOCALES = comfy_server.REPO_ROOT / "locales"
HELP_LOCALES = ("en", "zh")

JS_PACK_NODES = f"""(() => {{
  const graph = {JS_APP}.graph;
  const nodes = {json.dumps(PACK_TYPES)}.flatMap((type) => graph.findNodesByType(type) ?? []);
  // "$$" widgets are the frontend's own (the progress text), not the node's inputs.
  return nodes.map((n) => ({{id: String(n.id), type: n.type, widgets: (n.widgets ?? [])
    .filter((w) => !w.name.startsWith("$$")).map((w) => [w.name, w.value])}}));
}})()"""

JS_TOMA_NODES = f"""(() => {{
  const nodes = {JS_APP}.graph.findNodesByType("ToMA") ?? [];
  return nodes.map((n) => ({{id: n.id, widgets: (n.widgets ?? []).map((w) => [w.name, w.value])}}));
}})()"""


def _js_node(node_id: str) -> str:
    return f"{JS_APP}.graph.getNodeById({json.dumps(node_id)})"


def _js_text(node_id: str) -> str:
    """The node's progress text, or null."""
    return (f"({_js_node(node_id)}?.widgets ?? []).find((w) => w.name === "
            f"{json.dumps(TEXT_WIDGET)})?.value || null")


def _first_line(text: str) -> str:
    # Lines end in the two spaces that make a Markdown line break (nodes/ui_stats.py).
    return text.splitlines()[0].strip()


def _js_saved_widgets(node_id: str) -> str:
    """The node's widget values as the saved workflow stores them."""
    return (f"{JS_APP}.graph.serialize().nodes.find((n) => String(n.id) === "
            f"{json.dumps(node_id)})?.widgets_values ?? null")


# Files the frontend asks for in every fresh user directory and copes without (404).
OPTIONAL_USER_FILES = re.compile(
    r"^/(favicon\.ico|user\.css|api/userdata|api/userdata/(user\.css|comfy\.templates\.json))$")
# The pack's folder, node types and logger name ("automatic" must not count).
PACK_MARK = re.compile(rf"{re.escape(comfy_server.PACK_FOLDER)}|\bToMA")


# The frontend's help lookup: /extensions/<pack>/docs/<node>/<locale>.md first, then
# /extensions/<pack>/docs/<node>.md.
HELP_FIRST_TRY = re.compile(
    rf"^/extensions/{re.escape(comfy_server.PACK_FOLDER)}/docs/(\w+)/([\w-]+)\.md$")


def mentions_pack(entry: ConsoleEntry) -> bool:
    return PACK_MARK.search(f"{entry.text} {entry.url}") is not None


def help_fallback(entry: ConsoleEntry) -> bool:
    """The 404 of a help page in a language the pack has no page for, where the frontend goes
    on to the node's page in docs/ (English), which exists: the lookup working as designed."""
    match = HELP_FIRST_TRY.match(urllib.parse.urlsplit(entry.url).path)
    return (entry.source == "network" and "404" in entry.text and match is not None
            and not (DOCS / match[1] / f"{match[2]}.md").is_file()
            and (DOCS / f"{match[1]}.md").is_file())


def unavoidable_reason(entry: ConsoleEntry, origin: str) -> str | None:
    """Why an error is none of the pack's business, or None if it may be.

    Each rule was checked against the same ComfyUI without the pack, where it shows up the
    same way. Anything naming the pack is never excused, but for the help lookup's first try.
    """
    if help_fallback(entry):
        return "the help lookup tries the page in the UI's language first"
    if mentions_pack(entry):
        return None
    if entry.source == "network":
        url = urllib.parse.urlsplit(entry.url)
        if f"{url.scheme}://{url.netloc}" != origin:
            return "external request (update check, node docs): the test machine is offline"
        if "404" in entry.text and OPTIONAL_USER_FILES.match(url.path):
            return "optional file absent from the fresh user directory"
        if ("404" in entry.text and url.path == "/api/view"
                and "type=input" in url.query):
            return ("an example's Load Image previews its image, absent from the fresh input "
                    "directory")
    if (entry.source == "exception" and "addSetting" in entry.text
            and "reading 'id'" in entry.text):
        return "frontend 1.27 bug: a core setting's onChange runs before extensions load"
    if entry.text == "ComfyApp graph accessed before initialization":
        return "frontend 1.49 core reads app.rootGraph during startup"
    return None


@dataclass
class CanvasView:
    """The ToMA node in the classic canvas before and after its stats arrived."""

    text: str
    changed_pixels: int   # node region, before vs after the stats
    text_pixels: int      # node region, after vs the same with the text blanked
    widgets_before: list  # the node's widget values in the saved workflow, before the run
    widgets_saved: list   # the same, saved after the stats arrived
    widgets_reloaded: list  # the node's widget values after loading that saved workflow


@dataclass
class VueView:
    """The ToMA node in Nodes 2.0 mode after its stats arrived."""

    text: str
    node_text: str        # the node element's innerText (what is rendered, not hidden)
    rect: dict[str, float]
    on_top: bool          # the element under the text's centre belongs to the node


@dataclass
class TemplateView:
    """The template browser with the pack's examples selected."""

    visible_text: str
    thumbnail_widths: list[int]    # natural widths of the loaded pictures in the dialog
    served: dict[str, int]         # file in the pack's example folder -> HTTP status


@dataclass
class WorkflowRun:
    """A saved workflow opened in this frontend and run. Per pack node (by id): its type, the
    widget values the canvas shows, the inputs the frontend queues (links left out), the inputs
    the node's execute received (links by their value's type) and its hidden unique_id."""

    name: str
    types: dict[str, str] = field(default_factory=dict)
    widgets: dict[str, dict[str, Any]] = field(default_factory=dict)
    queued: dict[str, dict[str, Any]] = field(default_factory=dict)
    received: dict[str, dict[str, Any]] = field(default_factory=dict)
    unique_ids: dict[str, str | None] = field(default_factory=dict)  # hidden input, by node id
    statuses: list[str] = field(default_factory=list)


@dataclass
class HelpView:
    """A node's help as the frontend showed it after a click on the info button."""

    node_type: str
    locale: str
    text: str                   # the rendered text of the element holding the help page
    on_top: bool                # its first paragraph is what the page shows at that point
    images: list[dict[str, Any]]  # pictures in it: src attribute and natural width
    title: str                  # the node's title on the canvas
    labels: dict[str, str]      # widget name -> the label the frontend gives it
    name_elsewhere: bool        # the node's display name is in the page outside the help too


@dataclass
class SpeedCheckView:
    """The ToMA Speed Check node after a run, on the classic canvas."""

    text: str                   # its progress text (a line per variant)
    shown: str | None           # the rendered text of the element that shows it
    rect: dict[str, float] | None  # that element's box on screen


@dataclass
class PageRecord:
    """What the page showed during the session."""

    origin: str
    shots: Path
    toma_nodes: list[dict[str, Any]] = field(default_factory=list)
    canvas: CanvasView | None = None
    vue: VueView | None = None
    speed_check: SpeedCheckView | None = None
    templates: TemplateView | None = None
    runs: list[comfy_server.PromptRun] = field(default_factory=list)
    examples: list[WorkflowRun] = field(default_factory=list)
    saved: list[WorkflowRun] = field(default_factory=list)
    help: list[HelpView] = field(default_factory=list)
    console: list[ConsoleEntry] = field(default_factory=list)
    node_types: set[str] = field(default_factory=set)  # what this ComfyUI's /object_info lists
    seeds: int = 0

    def next_seed(self) -> int:
        """A seed no run of this session used yet (ComfyUI reuses a node's output while its
        inputs and those upstream stay the same, and then does not call the node)."""
        self.seeds += 1
        return 1000 + self.seeds

    def errors(self) -> list[tuple[ConsoleEntry, str | None]]:
        """Every error with the reason it is unavoidable (None: unexplained)."""
        return [(entry, unavoidable_reason(entry, self.origin))
                for entry in self.console if entry.level == "error"]

    def pack_complaints(self) -> list[ConsoleEntry]:
        return [entry for entry in self.console
                if mentions_pack(entry) and entry.level in ("warning", "error")
                and not help_fallback(entry)]


# Driving the page ------------------------------------------------------------------------------
async def _drive(cdp: Cdp, server: ComfyServer, record: PageRecord) -> None:
    workflow = json.loads(WORKFLOW.read_text())
    await _set_vue_nodes(cdp, False)
    await browser.load_workflow(cdp, workflow)
    record.toma_nodes = await cdp.evaluate(JS_TOMA_NODES)
    assert record.toma_nodes, "the example has no ToMA node"
    # Node ids are numbers up to frontend 1.35 and strings in 1.49; the backend sends strings,
    # and getNodeById takes either.
    node_id = str(record.toma_nodes[0]["id"])
    record.canvas = await _canvas_view(cdp, server, record, node_id)

    if "nodes_2" in RENDER_MODES:
        await _set_vue_nodes(cdp, True)
        await browser.load_workflow(cdp, workflow)
        record.vue = await _vue_view(cdp, server, record, node_id)
        await _set_vue_nodes(cdp, False)

    record.speed_check = await _speed_check_view(cdp, server, record)
    record.templates = await _template_view(cdp, record)
    record.node_types = set(server.get_json("/object_info"))
    for path in example_gate.examples_here(ch.comfy_version(), record.node_types):
        record.examples.append(await _run_example(cdp, server, record, path))
    for path in SAVED:
        record.saved.append(await _run_saved(cdp, server, record, path))
    for locale in HELP_LOCALES:
        # As a person does it: change the language, reload.
        await cdp.evaluate(f"{JS_APP}.extensionManager.setting.set('Comfy.Locale', "
                           f"{json.dumps(locale)}).then(() => true)")
        await browser.reload(cdp, UI_TIMEOUT_S)
        await _set_vue_nodes(cdp, False)
        await _names_in_locale(cdp, locale)
        for node_type in PACK_TYPES:
            record.help.append(await _help_view(cdp, record, node_type, locale))


# How long the names may take to follow a reload before the node definitions are refreshed.
NAMES_AFTER_RELOAD_S = 20.0


async def _names_in_locale(cdp: Cdp, locale: str) -> None:
    """Wait until the frontend's node types carry the pack's names in `locale`.

    The frontend translates the names when it fetches the node definitions and loads a
    language's own strings lazily; after a reload the fetch can win that race (frontend 1.35,
    at times), and the names stay English until the definitions are fetched again.
    A person then refreshes them (Edit > Refresh Node Definitions); so does this. A pack whose
    translations are missing or wrong still times out.
    """
    names = {node_type: display_name(node_type, locale) for node_type in PACK_TYPES}
    named = f"""(() => {{
      const types = globalThis.LiteGraph.registered_node_types, names = {json.dumps(names)};
      return Object.entries(names).every(([type, name]) => types[type]?.title === name);
    }})()"""
    try:
        await cdp.wait_for(named, NAMES_AFTER_RELOAD_S, f"the node names in {locale}")
    except AssertionError:
        log.warning("node names not in %s %.0f s after the reload: refreshing the node "
                    "definitions", locale, NAMES_AFTER_RELOAD_S)
        await cdp.evaluate(f"{JS_APP}.extensionManager.command.execute("
                           "'Comfy.RefreshNodeDefinitions').then(() => true)")
        await cdp.wait_for(named, UI_TIMEOUT_S, f"the node names in {locale} after a refresh")


def help_page(node_type: str, locale: str) -> str:
    """The Markdown the frontend must show for a node: docs/<node>/<locale>.md, which it asks
    for first, or in English docs/<node>.md, its fallback."""
    path = DOCS / f"{node_type}.md" if locale == "en" else DOCS / node_type / f"{locale}.md"
    return path.read_text()


def help_paragraphs(markdown: str) -> list[str]:
    """The page's headings, paragraphs and list items as rendered text (no tables, code or
    pictures): what the help must show."""
    shown = []
    for block in markdown.split("\n\n"):
        if block.startswith(("|", "```", "![")):
            continue
        for item in re.split(r"^- ", block, flags=re.MULTILINE):
            text = re.sub(r"[*`#]", "", item)
            text = " ".join(text.split())
            if text:
                shown.append(text)
    return shown


def display_name(node_type: str, locale: str) -> str:
    if locale == "en":
        return NODE_SPECS[node_type].display_name
    defs = json.loads((LOCALES / locale / "nodeDefs.json").read_text())
    return defs[node_type]["display_name"]


JS_INFO_BUTTON = """(() => {
  // The selection toolbox's button that opens the selected node's help (1.27 to 1.49).
  const button = document.querySelector('[data-testid="info-button"]');
  if (!button || button.offsetParent === null) return null;
  const r = button.getBoundingClientRect();
  return r.width > 0 ? {x: r.x + r.width / 2, y: r.y + r.height / 2} : null;
})()"""


def _js_help_shown(first: str, last: str, name: str) -> str:
    return f"""(() => {{
      const norm = (t) => (t ?? "").replace(/\\s+/g, " ").trim();
      const first = {json.dumps(first)}, last = {json.dumps(last)}, name = {json.dumps(name)};
      // The innermost element holding the first paragraph, and the one around it that holds
      // the whole page.
      const holders = [...document.querySelectorAll("body *")].filter(
        (e) => norm(e.textContent).includes(first));
      const holder = holders[holders.length - 1];
      let box = holder;
      while (box && !norm(box.innerText).includes(last)) box = box.parentElement;
      if (!box) return null;
      const images = [...box.querySelectorAll("img")].map(
        (img) => ({{src: img.getAttribute("src"), width: img.complete ? img.naturalWidth : 0}}));
      if (!images.length || images.some((img) => !img.width)) return null;  // still loading
      const r = holder.getBoundingClientRect();
      const top = document.elementFromPoint(r.x + Math.min(r.width / 2, 40),
                                            r.y + Math.min(r.height / 2, 8));
      const count = (text) => text.split(name).length - 1;
      return {{text: norm(box.innerText), on_top: holder.contains(top), images,
               name_elsewhere: count(norm(document.body.innerText)) > count(norm(box.innerText))}};
    }})()"""


async def _help_view(cdp: Cdp, record: PageRecord, node_type: str, locale: str) -> HelpView:
    # On an empty canvas, at scale 1, clear of the side bars (1.27's help opens on the left,
    # 1.35's and 1.49's on the right).
    node_id = await cdp.evaluate(f"""(() => {{
      const app = {JS_APP}, graph = app.graph, canvas = app.canvas;
      const node = globalThis.LiteGraph.createNode({json.dumps(node_type)});
      graph.clear();
      node.pos = [0, 0];
      graph.add(node);
      canvas.ds.scale = 1;
      canvas.ds.offset[0] = 420;
      canvas.ds.offset[1] = 240;
      canvas.setDirty(true, true);
      return String(node.id);
    }})()""")
    await cdp.frames(3)
    box = await _node_rect(cdp, node_id)
    title_height = await cdp.evaluate("globalThis.LiteGraph.NODE_TITLE_HEIGHT")
    await browser.click(cdp, box["x"] + 40, box["y"] + title_height / 2)  # select the node
    # Let the canvas draw the selection before looking for its toolbox: with Chromium 156 and
    # frontend 1.35, polling right after the click never saw the toolbox appear (120 s), while
    # the same poll after a few drawn frames finds it at once.
    await cdp.frames(10)
    button = await cdp.wait_for(JS_INFO_BUTTON, UI_TIMEOUT_S, "the selection toolbox's info button")
    await browser.click(cdp, button["x"], button["y"])
    paragraphs = help_paragraphs(help_page(node_type, locale))
    shown = await cdp.wait_for(
        _js_help_shown(paragraphs[1], paragraphs[-1], display_name(node_type, locale)),
        UI_TIMEOUT_S, f"the help page of {node_type} ({locale})")
    await cdp.frames(3)
    _save(record, f"help-{node_type}-{locale}.png", await cdp.screenshot())
    node = await cdp.evaluate(f"""(() => {{
      const node = {_js_node(node_id)};
      return {{title: node.title, labels: Object.fromEntries(
        (node.widgets ?? []).map((w) => [w.name, w.label ?? w.name]))}};
    }})()""")
    return HelpView(node_type, locale, shown["text"], shown["on_top"], shown["images"],
                    node["title"], node["labels"], shown["name_elsewhere"])


async def _open(cdp: Cdp, path: Path) -> tuple[WorkflowRun, dict[str, dict]]:
    """Open a saved workflow; what the canvas shows of the pack's nodes, and the API-format
    graph the frontend queues for it."""
    await browser.load_workflow(cdp, json.loads(path.read_text()))
    run = WorkflowRun(path.name)
    for node in await cdp.evaluate(JS_PACK_NODES):
        run.types[node["id"]] = node["type"]
        run.widgets[node["id"]] = dict(node["widgets"])
    graph = await saved_workflows.api_prompt(cdp)
    for node_id in run.types:
        run.queued[node_id] = {name: value for name, value in graph[node_id]["inputs"].items()
                               if not isinstance(value, list)}
    return run, graph


async def _receive(server: ComfyServer, record: PageRecord, run: WorkflowRun,
                   graph: dict[str, dict]) -> None:
    """Queue an API-format graph; keep its status and what the pack's nodes received."""
    result = await asyncio.to_thread(comfy_server.run_prompt, server, graph)
    run.statuses.append(result.history["status"]["status_str"])
    for call in comfy_server.recorded_calls(server, result.prompt_id):
        run.received[call["node"]] = call["inputs"]
        run.unique_ids[call["node"]] = call["unique_id"]


async def _run_example(cdp: Cdp, server: ComfyServer, record: PageRecord,
                       path: Path) -> WorkflowRun:
    """An example's ToMA nodes, each run with the inputs the frontend queues for it on the
    tiny SDXL (the examples' own models are not on this machine)."""
    run, graph = await _open(cdp, path)
    for node_id, node_type in run.types.items():
        seed = record.next_seed()
        await _receive(server, record, run, comfy_server.tiny_sdxl_graph(
            node_id, run.queued[node_id], seed=seed, toma_type=node_type, source_seed=seed))
    return run


async def _run_saved(cdp: Cdp, server: ComfyServer, record: PageRecord,
                     path: Path) -> WorkflowRun:
    """A workflow of saved_workflows/, run as it is (its graph uses only the test nodes)."""
    run, graph = await _open(cdp, path)
    seed = record.next_seed()
    for node in graph.values():
        if node["class_type"] == "ToMATestTinySDXL":
            node["inputs"]["seed"] = seed
        elif node["class_type"] == "ToMATestImage":
            node["inputs"]["width"] += 8 * (seed % 32)
    await _receive(server, record, run, graph)
    return run


async def _set_vue_nodes(cdp: Cdp, enabled: bool) -> None:
    await cdp.evaluate(f"{JS_APP}.extensionManager.setting.set('Comfy.VueNodes.Enabled', "
                       f"{json.dumps(enabled)}).then(() => true)")
    await cdp.frames()


async def _show_node(cdp: Cdp, node_id: str) -> None:
    """Scale 1, the node near the top left of the canvas."""
    await cdp.evaluate(f"""(() => {{
      const canvas = {JS_APP}.canvas, node = {_js_node(node_id)};
      canvas.ds.scale = 1;
      canvas.ds.offset[0] = 120 - node.pos[0];
      canvas.ds.offset[1] = 160 - node.pos[1];
      canvas.setDirty(true, true);
      return true;
    }})()""")
    await cdp.frames(3)


async def _node_rect(cdp: Cdp, node_id: str) -> dict[str, float]:
    """The node's box on screen (title included), from its graph position and size; the size
    is read by index because frontend 1.49 keeps it in a typed array."""
    return await cdp.evaluate(f"""(() => {{
      const canvas = {JS_APP}.canvas, node = {_js_node(node_id)};
      const box = canvas.canvas.getBoundingClientRect();
      const scale = canvas.ds.scale, offset = canvas.ds.offset;
      const title = globalThis.LiteGraph.NODE_TITLE_HEIGHT;
      return {{x: box.left + (node.pos[0] + offset[0]) * scale,
               y: box.top + (node.pos[1] - title + offset[1]) * scale,
               width: node.size[0] * scale, height: (node.size[1] + title) * scale}};
    }})()""")


async def _text_rect(cdp: Cdp, text: str) -> dict[str, float] | None:
    """The screen box of the element showing the text's first line, if the page has one
    (frontends 1.27-1.49 show progress text as HTML over the canvas, and 1.49 lets it hang
    below the node's box rather than growing the node)."""
    first_line = json.dumps(_first_line(text))
    return await cdp.evaluate(f"""(() => {{
      // The innermost element holding the line: the last match in document order.
      const holders = [...document.querySelectorAll("body *")].filter(
        (e) => e.textContent.includes({first_line}));
      if (!holders.length) return null;
      const r = holders[holders.length - 1].getBoundingClientRect();
      return {{x: r.x, y: r.y, width: r.width, height: r.height}};
    }})()""")


def _union(a: dict[str, float], b: dict[str, float] | None) -> dict[str, float]:
    if b is None:
        return a
    x0, y0 = min(a["x"], b["x"]), min(a["y"], b["y"])
    x1 = max(a["x"] + a["width"], b["x"] + b["width"])
    y1 = max(a["y"] + a["height"], b["y"] + b["height"])
    return {"x": x0, "y": y0, "width": x1 - x0, "height": y1 - y0}


async def _queue_run(cdp: Cdp, server: ComfyServer, record: PageRecord, node_id: str) -> str:
    """Run the tiny SDXL graph with a ToMA node of this id; the text the page then shows."""
    inputs = {**NODE_SPECS["ToMA"].defaults(), "ratio": 0.5}
    # A new seed per run: ComfyUI would answer an identical prompt from its cache, without
    # sampling (and without stats).
    graph = comfy_server.tiny_sdxl_graph(node_id, inputs, seed=len(record.runs))
    record.runs.append(await asyncio.to_thread(comfy_server.run_prompt, server, graph))
    text = await cdp.wait_for(_js_text(node_id), STATS_TIMEOUT_S, "the stats on the node")
    await cdp.frames(3)
    return text


def _save(record: PageRecord, name: str, png: bytes) -> np.ndarray:
    (record.shots / name).write_bytes(png)
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def _changed(a: np.ndarray, b: np.ndarray, rect: dict[str, float]) -> int:
    """Pixels inside `rect` that differ between two screenshots of the whole page."""
    x0, y0 = max(int(rect["x"]), 0), max(int(rect["y"]), 0)
    x1, y1 = int(rect["x"] + rect["width"]), int(rect["y"] + rect["height"])
    diff = np.abs(a[y0:y1, x0:x1] - b[y0:y1, x0:x1]).max(axis=-1)
    return int((diff > PIXEL_DELTA).sum())


async def _canvas_view(cdp: Cdp, server: ComfyServer, record: PageRecord,
                       node_id: str) -> CanvasView:
    await _show_node(cdp, node_id)
    widgets_before = await cdp.evaluate(_js_saved_widgets(node_id))
    before = _save(record, "canvas-1-before.png", await cdp.screenshot())
    text = await _queue_run(cdp, server, record, node_id)
    after = _save(record, "canvas-2-stats.png", await cdp.screenshot())
    rect = _union(await _node_rect(cdp, node_id), await _text_rect(cdp, text))

    # The same frame with only the text taken away: what differs is the text's own pixels.
    await cdp.evaluate(f"""(() => {{
      const widget = {_js_node(node_id)}.widgets.find((w) => w.name === {json.dumps(TEXT_WIDGET)});
      widget.value = "";
      return true;
    }})()""")
    await cdp.frames(3)
    blank = _save(record, "canvas-3-text-blanked.png", await cdp.screenshot())
    log.info("canvas screenshots in %s (ToMA node at %s)", record.shots, rect)

    # Save the workflow with the stats shown, and open it again.
    await cdp.evaluate(f"""(() => {{
      const widget = {_js_node(node_id)}.widgets.find((w) => w.name === {json.dumps(TEXT_WIDGET)});
      widget.value = {json.dumps(text)};
      return true;
    }})()""")
    saved = await cdp.evaluate(f"{JS_APP}.graph.serialize()")
    widgets_saved = next(n["widgets_values"] for n in saved["nodes"] if str(n["id"]) == node_id)
    await browser.load_workflow(cdp, saved)
    reloaded = next(n for n in await cdp.evaluate(JS_TOMA_NODES) if str(n["id"]) == node_id)
    return CanvasView(text, _changed(before, after, rect), _changed(after, blank, rect),
                      widgets_before, widgets_saved, [value for _, value in reloaded["widgets"]])


async def _speed_check_view(cdp: Cdp, server: ComfyServer, record: PageRecord) -> SpeedCheckView:
    """A Speed Check node alone on the canvas; a graph run with its id; what the node shows."""
    node_id = await cdp.evaluate(f"""(() => {{
      const graph = {JS_APP}.graph, node = globalThis.LiteGraph.createNode("ToMASpeedCheck");
      graph.clear();
      node.pos = [0, 0];
      graph.add(node);
      return String(node.id);
    }})()""")
    await _show_node(cdp, node_id)
    graph = comfy_server.speed_check_graph(
        node_id, {**NODE_SPECS["ToMASpeedCheck"].defaults(), "ratios": "0.25", "calls": 1},
        {**NODE_SPECS["ToMA"].defaults(), "ratio": 0.5}, source_seed=record.next_seed())
    record.runs.append(await asyncio.to_thread(comfy_server.run_prompt, server, graph))
    text = await cdp.wait_for(_js_text(node_id), STATS_TIMEOUT_S, "the speed check's lines")
    await cdp.frames(3)
    _save(record, "speed-check.png", await cdp.screenshot())
    # The innermost element showing the connected row, and the box around it.
    shown = await cdp.evaluate(f"""(() => {{
      const holders = [...document.querySelectorAll("body *")].filter(
        (e) => e.textContent.includes({json.dumps(SPEED_CHECK_ROW)}));
      if (!holders.length) return null;
      const holder = holders[holders.length - 1], box = holder.getBoundingClientRect();
      return {{text: holder.innerText,
               rect: {{x: box.x, y: box.y, width: box.width, height: box.height}}}};
    }})()""")
    return SpeedCheckView(text, shown and shown["text"], shown and shown["rect"])


async def _vue_view(cdp: Cdp, server: ComfyServer, record: PageRecord, node_id: str) -> VueView:
    element = f"document.querySelector('[data-node-id=\"{node_id}\"]')"
    await cdp.wait_for(f"!!{element}", UI_TIMEOUT_S, "the ToMA node's Nodes 2.0 element")
    await _show_node(cdp, node_id)
    _save(record, "vue-1-before.png", await cdp.screenshot())
    text = await _queue_run(cdp, server, record, node_id)
    first_line = _first_line(text)
    shown = await cdp.wait_for(f"""(() => {{
      const node = {element};
      if (!node || !node.innerText.includes({json.dumps(first_line)})) return null;
      // The innermost element holding the line, and what is on top at its centre.
      const holders = [...node.querySelectorAll("*")].filter(
        (e) => e.textContent.includes({json.dumps(first_line)}));
      const holder = holders[holders.length - 1];
      const r = holder.getBoundingClientRect();
      const top = document.elementFromPoint(r.x + r.width / 2, r.y + r.height / 2);
      return {{nodeText: node.innerText, on_top: node.contains(top),
               rect: {{x: r.x, y: r.y, width: r.width, height: r.height}}}};
    }})()""", STATS_TIMEOUT_S, "the stats text in the Nodes 2.0 node")
    _save(record, "vue-2-stats.png", await cdp.screenshot())
    log.info("Nodes 2.0 screenshots in %s (text at %s)", record.shots, shown["rect"])
    return VueView(text, shown["nodeText"], shown["rect"], shown["on_top"])


async def _template_view(cdp: Cdp, record: PageRecord) -> TemplateView:
    await cdp.evaluate(f"{JS_APP}.extensionManager.command.execute('Comfy.BrowseTemplates')"
                       ".then(() => true)")
    # The pack's entry in the dialog's list of categories: clicked (again, while the dialog is
    # still loading) until its templates show.
    click = f"""(() => {{
      const items = [...document.querySelectorAll("[role=dialog] *")].filter(
        (e) => e.children.length === 0 && e.textContent.trim() === {json.dumps(CATEGORY_TITLE)});
      items[0]?.click();
      return items.length > 0;
    }})()"""
    # Thumbnails load lazily when their card is in view (as blob: URLs in 1.35 and 1.49); at
    # this window size 1.27 shows two cards and clips the rest (every title is still in the
    # page's rendered text). tests/integration/test_server.py fetches every thumbnail.
    stems = json.dumps(sorted(path.stem for path in EXAMPLES.glob("*.json")))
    state = f"""(() => {{
      const text = [...document.querySelectorAll("[role=dialog]")].map((d) => d.innerText)
        .join("\\n");
      const images = [...document.querySelectorAll("[role=dialog] img")];
      return {{text, titles: {stems}.every((stem) => text.includes(stem)),
               widths: images.filter((img) => img.complete && img.naturalWidth > 0)
                             .map((img) => img.naturalWidth)}};
    }})()"""
    marker = f"/workflow_templates/{comfy_server.PACK_FOLDER}/"
    deadline = time.monotonic() + UI_TIMEOUT_S
    while True:
        shown = await cdp.evaluate(state)
        served = {urllib.parse.unquote(url).split(marker, 1)[1]: status
                  for url, status in cdp.responses if marker in urllib.parse.unquote(url)}
        if shown["titles"] and served and len(shown["widths"]) >= len(served):
            break
        assert time.monotonic() < deadline, f"the examples in the template browser: {shown}"
        if not shown["titles"]:
            await cdp.evaluate(click)
        await asyncio.sleep(0.25)
    await cdp.frames(3)
    _save(record, "templates.png", await cdp.screenshot())
    return TemplateView(shown["text"], shown["widths"], served)


async def _browse(server: ComfyServer, port: int, shots: Path) -> PageRecord:
    record = PageRecord(origin=server.url, shots=shots)
    cdp = None
    try:
        async with browser.comfy_page(port, server.url + "/", UI_TIMEOUT_S) as cdp:
            try:
                await _drive(cdp, server, record)
            except Exception:
                _save(record, "failed.png", await cdp.screenshot())
                raise
    finally:
        if cdp is not None:
            record.console = list(cdp.console)
        for entry in record.console:  # also when the session failed half-way
            log.debug("page console [%s/%s] %s %s", entry.source, entry.level, entry.text,
                      entry.url)
    return record


# Fixtures and tests ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chromium() -> str:
    executable = browser.find_chromium()
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
def page(server: ComfyServer, chromium: str, comfyui_path: Path,
         tmp_path_factory: pytest.TempPathFactory) -> PageRecord:
    shots = Path(os.environ.get("TOMA_SCREENSHOT_DIR") or tmp_path_factory.mktemp("shots"))
    shots = shots / comfyui_path.name
    shots.mkdir(parents=True, exist_ok=True)
    profile = tmp_path_factory.mktemp("chromium") / "profile"
    with browser.running_chromium(chromium, profile) as port:
        return asyncio.run(_browse(server, port, shots))


def test_workflow_loads_with_toma_widgets(page: PageRecord) -> None:
    workflow = json.loads(WORKFLOW.read_text())
    expected = {str(node["id"]): node["widgets_values"] for node in workflow["nodes"]
                if node["type"] == "ToMA"}
    loaded = {str(node["id"]): [value for _, value in node["widgets"]]
              for node in page.toma_nodes}
    assert loaded == expected
    widget_inputs = [name for name, (kind, _) in NODE_SPECS["ToMA"].inputs.items()
                     if isinstance(kind, list) or kind in WIDGET_TYPES]
    assert [name for name, _ in page.toma_nodes[0]["widgets"]] == widget_inputs


def test_runs_succeed(page: PageRecord) -> None:
    statuses = [run.history["status"]["status_str"] for run in page.runs]
    assert statuses == ["success"] * (len(RENDER_MODES) + 1)   # and the speed check's


@pytest.mark.parametrize("mode", RENDER_MODES)
def test_stats_are_visible(page: PageRecord, mode: str) -> None:
    {"canvas": _check_canvas, "nodes_2": _check_nodes_2}[mode](page)


def _check_canvas(page: PageRecord) -> None:
    view = page.canvas
    assert view is not None
    assert STATS_LINE.match(view.text), view.text
    assert view.changed_pixels >= MIN_TEXT_PIXELS, view
    assert view.text_pixels >= MIN_TEXT_PIXELS, view
    # The text is shown, not part of the settings: a workflow saved after the run keeps the
    # node's widget values and opens with them. Frontend 1.35 (ComfyUI 0.8.0) also saves the
    # text, after them (widget values are positional: see nodes/toma_node.py); 1.27 and 1.49
    # do not.
    count = len(view.widgets_before)
    assert view.widgets_saved[:count] == view.widgets_before
    assert view.widgets_saved[count:] in ([], [view.text])
    assert view.widgets_reloaded == view.widgets_before


def _check_nodes_2(page: PageRecord) -> None:
    view = page.vue
    assert view is not None
    assert STATS_LINE.match(view.text), view.text
    assert _first_line(view.text) in view.node_text
    assert view.rect["width"] > 0 and view.rect["height"] > 0, view
    assert 0 <= view.rect["x"] and view.rect["x"] + view.rect["width"] <= browser.WINDOW[0]
    assert view.on_top, view


def test_speed_check_results_are_visible(page: PageRecord) -> None:
    view = page.speed_check
    assert view is not None
    assert SPEED_CHECK_ROW in view.text, view.text
    # Every line is in the element on screen, with its speed-up; ToMA's first, where the box
    # shows it without scrolling.
    assert view.shown is not None, view
    assert view.shown.startswith(SPEED_CHECK_ROW + ": "), view
    for label in ("ToMA 0.25: ", "unmerged: 1.00x"):
        assert label in view.shown, view
    assert len(re.findall(r"\d+\.\d\dx", view.shown)) == 3, view.shown
    assert view.rect["width"] > 0 and view.rect["height"] > 0, view
    assert 0 <= view.rect["x"] and view.rect["x"] + view.rect["width"] <= browser.WINDOW[0]


def test_template_browser_shows_titles_and_thumbnails(page: PageRecord) -> None:
    view = page.templates
    assert view is not None
    stems = {path.stem for path in EXAMPLES.glob("*.json")}
    for stem in stems:
        assert stem in view.visible_text, stem
    # Every picture the dialog asked for is an example's thumbnail, served, and shown.
    assert view.served, "the dialog asked for no thumbnail"
    assert view.served == {f"{stem}.jpg": 200 for stem in stems if f"{stem}.jpg" in view.served}
    assert len(view.thumbnail_widths) >= len(view.served), (view.thumbnail_widths, view.served)


def _widget_names(node_type: str) -> list[str]:
    return [name for name, (kind, _) in NODE_SPECS[node_type].inputs.items()
            if isinstance(kind, list) or kind in WIDGET_TYPES]


@pytest.mark.parametrize("example", example_gate.example_files(), ids=lambda path: path.stem)
def test_examples_reach_the_nodes_input_by_input(page: PageRecord, example: Path) -> None:
    if not example_gate.runs_here(example, ch.comfy_version(), page.node_types):
        # Below the example's minimum ComfyUI, with some of its nodes missing here: not opened.
        assert all(run.name != example.name for run in page.examples)
        return
    run = next(run for run in page.examples if run.name == example.name)
    saved = {str(node["id"]): node for node in json.loads(example.read_text())["nodes"]
             if node["type"] in PACK_TYPES}
    assert set(run.types) == set(saved) and any(t in TOMA_TYPES for t in run.types.values())
    assert run.statuses == ["success"] * len(saved), run.statuses
    for node_id, node in saved.items():
        # V1 semantics: the n-th saved value is the n-th widget input.
        names = _widget_names(node["type"])
        expected = dict(zip(names, node["widgets_values"][:len(names)], strict=True))
        assert run.widgets[node_id] == expected, node_id
        assert run.queued[node_id] == expected, node_id
        assert run.received[node_id] == {**expected, "model": LINKED_INPUTS["model"]}, node_id
        assert run.unique_ids[node_id] == node_id  # where the node's stats are sent


@pytest.mark.parametrize("path", SAVED, ids=lambda path: path.stem)
def test_workflows_saved_with_the_v1_nodes_run_with_every_value_in_place(
        page: PageRecord, path: Path) -> None:
    run = next(run for run in page.saved if run.name == path.name)
    assert sorted(run.types.values()) == sorted(saved_workflows.VALUES), run.types
    assert run.statuses == ["success"], run.statuses
    for node_id, node_type in run.types.items():
        expected = saved_workflows.VALUES[node_type]
        assert list(run.widgets[node_id]) == _widget_names(node_type), node_id
        assert run.widgets[node_id] == expected, (node_type, run.widgets[node_id])
        assert run.queued[node_id] == expected, (node_type, run.queued[node_id])
        linked = {name: LINKED_INPUTS[name] for name in NODE_SPECS[node_type].inputs
                  if name in LINKED_INPUTS}
        assert run.received[node_id] == {**expected, **linked}, (node_type, run.received)
        assert run.unique_ids[node_id] == (node_id if node_type in TOMA_TYPES else None)


@pytest.mark.parametrize("locale", HELP_LOCALES)
@pytest.mark.parametrize("node_type", PACK_TYPES)
def test_help_page_opens_from_the_info_button(page: PageRecord, node_type: str,
                                              locale: str) -> None:
    view = next(v for v in page.help if (v.node_type, v.locale) == (node_type, locale))
    for paragraph in help_paragraphs(help_page(node_type, locale)):
        assert paragraph in view.text, paragraph
    assert view.on_top, view.text[:200]
    # The page's pictures, from the pack's web/docs/ (the frontend resolves them against docs/),
    # loaded at their own width.
    pictures = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", help_page(node_type, locale))
    assert pictures
    assert [image["src"] for image in view.images] == \
        [f"/extensions/{comfy_server.PACK_FOLDER}/docs/{name}" for name in pictures]
    assert [image["width"] for image in view.images] == \
        [Image.open(DOCS / name).width for name in pictures]


@pytest.mark.parametrize("locale", HELP_LOCALES)
@pytest.mark.parametrize("node_type", PACK_TYPES)
def test_node_names_follow_the_language(page: PageRecord, node_type: str, locale: str) -> None:
    view = next(v for v in page.help if (v.node_type, v.locale) == (node_type, locale))
    assert view.title == display_name(node_type, locale)
    assert view.name_elsewhere, "the display name is shown with the help (its header)"
    widgets = _widget_names(node_type)
    if locale == "en":
        assert view.labels == {name: name for name in widgets}
    else:
        defs = json.loads((LOCALES / locale / "nodeDefs.json").read_text())[node_type]
        assert view.labels == {name: defs["inputs"][name]["name"] for name in widgets}


def test_no_console_errors(page: PageRecord) -> None:
    assert not page.pack_complaints(), page.pack_complaints()
    errors = page.errors()
    for entry, reason in errors:
        if reason is not None:
            log.info("ignored console error (%s): %s %s", reason, entry.text[:200], entry.url)
    unexplained = [entry for entry, reason in errors if reason is None]
    assert not unexplained, unexplained
