// Unit tests for web/toma_stats_format.js: run with `node --test tests/js/`.
import { test } from "node:test";
import assert from "node:assert/strict";

import {
  SEPARATOR,
  TOMA_NODE_TYPES,
  fitText,
  formatLevels,
  formatPercent,
  formatStats,
  layoutLines,
  messageNodeId,
  nodeIdPath,
  parseStatsMessage,
  statsForNode,
} from "../../web/toma_stats_format.js";

const FULL = {
  ratio: 0.5,
  family: "unet",
  layers_merged: 60,
  layers_total: 70,
  steps_merged: 20,
  steps_total: 28,
  planning_s: 0.3,
  sampling_s: 10,
  levels: [{ name: "d1", tokens: 4096, merged_tokens: 2048 }],
};

// One "character" = one unit of width.
const charWidth = (s) => s.length;

test("full stats give the documented line", () => {
  assert.equal(
    formatStats(FULL),
    "50% merged · 60/70 layers · 20/28 steps · planning 3% of step time",
  );
  assert.equal(SEPARATOR, " · ");
});

test("note is appended last", () => {
  assert.equal(
    formatStats({ ratio: 0, note: "nothing merged: image too small" }),
    "0% merged · nothing merged: image too small",
  );
  assert.equal(formatStats({ note: "  only\n a   note " }), "only a note");
  assert.equal(formatStats({ ratio: 0.5, note: "" }), "50% merged");
  assert.equal(formatStats({ ratio: 0.5, note: 42 }), "50% merged");
});

test("long notes are shortened", () => {
  const text = formatStats({ note: "x".repeat(1000) });
  assert.ok(text.length <= 160);
  assert.ok(text.endsWith("…"));
});

test("missing parts are omitted", () => {
  assert.equal(formatStats({ ratio: 0.25 }), "25% merged");
  assert.equal(formatStats({ layers_merged: 3, layers_total: 10 }), "3/10 layers");
  assert.equal(formatStats({ steps_merged: 4 }), "4 steps");
  assert.equal(formatStats({ steps_total: 4 }), null);
  assert.equal(formatStats({ ratio: 0.5, steps_merged: 2, steps_total: 0 }), "50% merged · 2 steps");
  assert.equal(formatStats({ family: "flux" }), null);
  assert.equal(formatStats({}), null);
});

test("planning percent needs a positive sampling time", () => {
  assert.equal(formatStats({ planning_s: 1 }), null);
  assert.equal(formatStats({ planning_s: 1, sampling_s: 0 }), null);
  assert.equal(formatStats({ planning_s: 1, sampling_s: -3 }), null);
  assert.equal(formatStats({ sampling_s: 10 }), null);
  assert.equal(formatStats({ planning_s: -1, sampling_s: 10 }), null);
  assert.equal(formatStats({ planning_s: 0.05, sampling_s: 10 }), "planning <1% of step time");
  assert.equal(formatStats({ planning_s: 0.0999, sampling_s: 10 }), "planning <1% of step time");
  assert.equal(formatStats({ planning_s: 0.1, sampling_s: 10 }), "planning 1% of step time");
  assert.equal(formatStats({ planning_s: 0, sampling_s: 10 }), "planning 0% of step time");
  assert.equal(formatStats({ planning_s: 1.26, sampling_s: 10 }), "planning 13% of step time");
});

test("ratio rounding and range", () => {
  assert.equal(formatStats({ ratio: 1 / 3 }), "33% merged");
  assert.equal(formatStats({ ratio: 0.666 }), "67% merged");
  assert.equal(formatStats({ ratio: 0.004 }), "<1% merged");
  assert.equal(formatStats({ ratio: 0.9999 }), ">99% merged");
  assert.equal(formatStats({ ratio: 1 }), "100% merged");
  assert.equal(formatStats({ ratio: 1 + 1e-12 }), "100% merged");
  assert.equal(formatStats({ ratio: 0 }), "0% merged");
  assert.equal(formatStats({ ratio: -0.1 }), null);
  assert.equal(formatStats({ ratio: 1.5 }), null);
  assert.equal(formatStats({ ratio: NaN }), null);
  assert.equal(formatStats({ ratio: Infinity }), null);
  assert.equal(formatStats({ ratio: "0.5" }), null);
});

test("counts are rounded and negatives dropped", () => {
  assert.equal(formatStats({ layers_merged: 2.6, layers_total: 9.2 }), "3/9 layers");
  assert.equal(formatStats({ layers_merged: -1, layers_total: 9 }), null);
  assert.equal(formatStats({ layers_merged: 1, layers_total: -9 }), "1 layers");
  assert.equal(formatStats({ layers_merged: "60", layers_total: 70 }), null);
});

test("garbage input gives null and never throws", () => {
  for (const bad of [null, undefined, 0, 1, "", "stats", true, [], [1, 2], () => 1, Symbol("s")]) {
    assert.equal(formatStats(bad), null, String(typeof bad));
  }
  const weird = { ratio: {}, layers_merged: [], layers_total: null, steps_merged: {}, note: {} };
  assert.equal(formatStats(weird), null);
  assert.equal(formatStats(Object.create(null)), null);
});

test("formatPercent", () => {
  assert.equal(formatPercent(0.5), "50%");
  assert.equal(formatPercent(0.005), "<1%");
  assert.equal(formatPercent(0.995), ">99%");
  assert.equal(formatPercent(2), "200%");
  assert.equal(formatPercent(-0.5), null);
  assert.equal(formatPercent("x"), null);
});

test("formatLevels", () => {
  assert.deepEqual(formatLevels(FULL), ["d1: 4096 → 2048 tokens"]);
  assert.deepEqual(
    formatLevels({ levels: [null, 3, { name: "u0", tokens: 10 }, { tokens: "x" }, { merged_tokens: 5 }] }),
    ["u0: 10 tokens", "?: 5 tokens"],
  );
  assert.deepEqual(formatLevels({ levels: "nope" }), []);
  assert.deepEqual(formatLevels(null), []);
});

test("messageNodeId", () => {
  assert.equal(messageNodeId({ node: "12" }), "12");
  assert.equal(messageNodeId({ node: 12 }), "12");
  assert.equal(messageNodeId({ node: " 7 " }), "7");
  assert.equal(messageNodeId({ node: "" }), null);
  assert.equal(messageNodeId({ node: 1.5 }), null);
  assert.equal(messageNodeId({ node: null }), null);
  assert.equal(messageNodeId({}), null);
  assert.equal(messageNodeId("12"), null);
  assert.equal(messageNodeId(null), null);
});

test("statsForNode matches ids as strings", () => {
  const msg = { node: "12", stats: FULL };
  assert.equal(statsForNode(msg, "12"), FULL);
  assert.equal(statsForNode(msg, 12), FULL);
  assert.equal(statsForNode({ node: 12, stats: FULL }, "12"), FULL);
  assert.equal(statsForNode(msg, "13"), null);
  assert.equal(statsForNode(msg, "1"), null);
  assert.equal(statsForNode(msg, "120"), null);
  assert.equal(statsForNode(msg, null), null);
  assert.equal(statsForNode(msg, undefined), null);
  assert.equal(statsForNode({ node: "3:12", stats: FULL }, "3:12"), FULL);
  assert.equal(statsForNode({ node: "3:12", stats: FULL }, "12"), null);
});

test("statsForNode rejects malformed messages", () => {
  assert.equal(statsForNode({ node: "12" }, "12"), null);
  assert.equal(statsForNode({ node: "12", stats: null }, "12"), null);
  assert.equal(statsForNode({ node: "12", stats: "50%" }, "12"), null);
  assert.equal(statsForNode({ node: "12", stats: [1] }, "12"), null);
  assert.equal(statsForNode({ stats: FULL }, "12"), null);
  assert.equal(statsForNode(null, "12"), null);
  assert.equal(statsForNode("garbage", "12"), null);
});

test("nodeIdPath", () => {
  assert.deepEqual(nodeIdPath("12"), [12]);
  assert.deepEqual(nodeIdPath(12), [12]);
  assert.deepEqual(nodeIdPath("3:12"), [3, 12]);
  assert.deepEqual(nodeIdPath("3:4:5"), [3, 4, 5]);
  assert.equal(nodeIdPath("3:"), null);
  assert.equal(nodeIdPath("abc"), null);
  assert.equal(nodeIdPath("-1"), null);
  assert.equal(nodeIdPath("1.5"), null);
  assert.equal(nodeIdPath("99999999999999999999"), null);
  assert.equal(nodeIdPath(-1), null);
  assert.equal(nodeIdPath(null), null);
  assert.equal(nodeIdPath({}), null);
});

test("parseStatsMessage", () => {
  assert.deepEqual(parseStatsMessage({ node: "5", stats: { ratio: 0.5 } }), {
    id: "5",
    path: [5],
    text: "50% merged",
    stats: { ratio: 0.5 },
  });
  const empty = parseStatsMessage({ node: "2:5", stats: {} });
  assert.deepEqual(empty.path, [2, 5]);
  assert.equal(empty.text, null);
  assert.equal(parseStatsMessage({ node: "x", stats: {} }), null);
  assert.equal(parseStatsMessage({ node: "5" }), null);
  assert.equal(parseStatsMessage(undefined), null);
});

test("fitText shortens with an ellipsis", () => {
  assert.equal(fitText("hello world", 100, charWidth), "hello world");
  assert.equal(fitText("hello world", 6, charWidth), "hello…");
  assert.equal(fitText("hello world", 1, charWidth), "");
  assert.equal(fitText("hello", 0, charWidth), "hello");
  assert.equal(fitText("hello", 3, null), "hello");
  assert.equal(fitText(null, 3, charWidth), "");
  for (let w = 2; w < 12; w++) assert.ok(charWidth(fitText("hello world", w, charWidth)) <= w);
});

test("layoutLines breaks at separators", () => {
  const text = formatStats(FULL);
  assert.deepEqual(layoutLines(text, 1000, charWidth), [text]);
  assert.deepEqual(layoutLines(text, 40, charWidth, 3), [
    "50% merged · 60/70 layers · 20/28 steps",
    "planning 3% of step time",
  ]);
  const two = layoutLines(text, 26, charWidth, 2);
  assert.equal(two.length, 2);
  assert.equal(two[0], "50% merged · 60/70 layers");
  assert.ok(two[1].endsWith("…"));
  assert.ok(two.every((l) => l.length <= 26));
  assert.deepEqual(layoutLines("", 10, charWidth), []);
  assert.deepEqual(layoutLines(null, 10, charWidth), []);
  assert.deepEqual(layoutLines("abc", 0, charWidth), ["abc"]);
});

test("node types", () => {
  assert.deepEqual([...TOMA_NODE_TYPES], ["ToMA", "ToMAAdvanced"]);
});
