// ToMA: show the merge statistics of the last sampling run under each ToMA node.
// SPDX-License-Identifier: GPL-3.0-or-later
//
// The backend sends PromptServer.instance.send_sync("toma.stats", {node, stats}) after
// sampling. All formatting lives in toma_stats_format.js (pure, unit-tested); this file
// only finds the node, stores the text and draws it. Nothing here may throw into the app.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { TOMA_NODE_TYPES, layoutLines, parseStatsMessage } from "./toma_stats_format.js";

const EVENT = "toma.stats";
const FONT_PX = 11;
const LINE_HEIGHT = 14;
const MAX_LINES = 2;

function warn(...args) {
  try {
    console.warn("[ToMA stats]", ...args);
  } catch {
    // no console: nothing to do
  }
}

// Walk "outer:inner" execution ids through subgraphs; a plain id is a one-step path.
function findNode(path) {
  let graph = app?.graph;
  let node = null;
  for (let i = 0; i < path.length; i++) {
    if (!graph || typeof graph.getNodeById !== "function") return null;
    node = graph.getNodeById(path[i]);
    if (!node) return null;
    graph = node.subgraph;
  }
  return node;
}

function redraw(node) {
  try {
    node?.setDirtyCanvas?.(true, true);
    app?.graph?.setDirtyCanvas?.(true, true);
  } catch (e) {
    warn("redraw failed", e);
  }
}

function onStats(event) {
  try {
    const parsed = parseStatsMessage(event?.detail ?? event);
    if (!parsed) return;
    const node = findNode(parsed.path);
    if (!node) return;
    node.toma_stats = { text: parsed.text, stats: parsed.stats, received: Date.now() };
    redraw(node);
  } catch (e) {
    warn("could not apply stats", e);
  }
}

function drawStats(node, ctx) {
  const text = node?.toma_stats?.text;
  if (!text || !ctx || node.flags?.collapsed) return;
  const width = Array.isArray(node.size) || ArrayBuffer.isView(node.size) ? node.size[0] : 0;
  const height = Array.isArray(node.size) || ArrayBuffer.isView(node.size) ? node.size[1] : 0;
  if (!(width > 0) || !(height > 0)) return;
  ctx.save();
  try {
    ctx.font = `${FONT_PX}px sans-serif`;
    ctx.textAlign = "left";
    ctx.textBaseline = "top";
    ctx.fillStyle = "#9fb4c8";
    const measure = (s) => ctx.measureText(s).width;
    const lines = layoutLines(text, Math.max(width - 8, 40), measure, MAX_LINES);
    // Just below the node's body, outside its box, so widgets are never covered.
    lines.forEach((line, i) => ctx.fillText(line, 4, height + 4 + i * LINE_HEIGHT));
  } finally {
    ctx.restore();
  }
}

app.registerExtension({
  name: "toma.stats",

  setup() {
    try {
      if (typeof api?.addEventListener === "function") api.addEventListener(EVENT, onStats);
    } catch (e) {
      warn("could not listen for stats", e);
    }
  },

  beforeRegisterNodeDef(nodeType, nodeData) {
    try {
      if (!nodeType?.prototype || !TOMA_NODE_TYPES.includes(nodeData?.name)) return;
      const original = nodeType.prototype.onDrawForeground;
      nodeType.prototype.onDrawForeground = function (ctx, ...rest) {
        const result = typeof original === "function" ? original.call(this, ctx, ...rest) : undefined;
        try {
          drawStats(this, ctx);
        } catch (e) {
          // Drawing runs every frame: never throw out of it, warn once per node.
          if (!this.toma_stats_warned) {
            this.toma_stats_warned = true;
            warn("could not draw stats", e);
          }
        }
        return result;
      };
    } catch (e) {
      warn("could not hook node drawing", e);
    }
  },
});
