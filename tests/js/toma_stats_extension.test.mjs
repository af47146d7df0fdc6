// Loads web/toma_stats.js the way the ComfyUI frontend does (as an ES module importing
// ../../scripts/app.js and ../../scripts/api.js), against small stand-ins for app and api.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { cpSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const webDir = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "web");

class FakeApi extends EventTarget {}

class FakeNode {
  constructor(id, type, subgraph = null) {
    this.id = id;
    this.type = type;
    this.size = [300, 120];
    this.flags = {};
    this.subgraph = subgraph;
    this.dirty = 0;
  }
  setDirtyCanvas() {
    this.dirty += 1;
  }
}

class FakeGraph {
  constructor(nodes) {
    this.nodes = new Map(nodes.map((n) => [n.id, n]));
    this.dirty = 0;
  }
  getNodeById(id) {
    return this.nodes.get(id) ?? null;
  }
  setDirtyCanvas() {
    this.dirty += 1;
  }
}

class FakeCtx {
  constructor() {
    this.texts = [];
    this.depth = 0;
  }
  save() {
    this.depth += 1;
  }
  restore() {
    this.depth -= 1;
  }
  measureText(s) {
    return { width: s.length * 6 };
  }
  fillText(text, x, y) {
    this.texts.push({ text, x, y });
  }
}

let dir;
let extensions;
let api;
let app;

before(async () => {
  dir = mkdtempSync(join(tmpdir(), "toma-web-"));
  mkdirSync(join(dir, "scripts"));
  mkdirSync(join(dir, "extensions", "comfyui-toma"), { recursive: true });
  writeFileSync(join(dir, "scripts", "app.js"), "export const app = globalThis.__tomaApp;\n");
  writeFileSync(join(dir, "scripts", "api.js"), "export const api = globalThis.__tomaApi;\n");
  cpSync(webDir, join(dir, "extensions", "comfyui-toma"), { recursive: true });

  extensions = [];
  api = new FakeApi();
  app = { graph: null, registerExtension: (ext) => extensions.push(ext) };
  globalThis.__tomaApp = app;
  globalThis.__tomaApi = api;

  // The frontend imports every .js in web/; the pure module must load without side effects.
  const ext = join(dir, "extensions", "comfyui-toma");
  await import(pathToFileURL(join(ext, "toma_stats_format.js")).href);
  assert.equal(extensions.length, 0);
  await import(pathToFileURL(join(ext, "toma_stats.js")).href);
});

after(() => {
  rmSync(dir, { recursive: true, force: true });
  delete globalThis.__tomaApp;
  delete globalThis.__tomaApi;
});

function send(detail) {
  api.dispatchEvent(new CustomEvent("toma.stats", { detail }));
}

function hookedType(name) {
  const type = class extends FakeNode {};
  extensions[0].beforeRegisterNodeDef(type, { name }, app);
  return type;
}

test("registers one extension named toma.stats", () => {
  assert.equal(extensions.length, 1);
  assert.equal(extensions[0].name, "toma.stats");
  extensions[0].setup();
});

test("only ToMA node types get a drawing hook, existing hooks are kept", () => {
  const other = class extends FakeNode {};
  extensions[0].beforeRegisterNodeDef(other, { name: "KSampler" }, app);
  assert.equal(other.prototype.onDrawForeground, undefined);

  let calls = 0;
  const adv = class extends FakeNode {};
  adv.prototype.onDrawForeground = function () {
    calls += 1;
    return "kept";
  };
  extensions[0].beforeRegisterNodeDef(adv, { name: "ToMAAdvanced" }, app);
  const node = new adv(1, "ToMAAdvanced");
  assert.equal(node.onDrawForeground(new FakeCtx()), "kept");
  assert.equal(calls, 1);

  // Odd arguments from old or new frontends are ignored.
  extensions[0].beforeRegisterNodeDef(undefined, undefined, app);
  extensions[0].beforeRegisterNodeDef({}, { name: "ToMA" }, app);
});

test("a message for a node stores the text and draws it under the node", () => {
  const ToMA = hookedType("ToMA");
  const node = new ToMA(7, "ToMA");
  app.graph = new FakeGraph([node]);

  const ctx = new FakeCtx();
  node.onDrawForeground(ctx);
  assert.deepEqual(ctx.texts, []);

  send({ node: "7", stats: { ratio: 0.5, steps_merged: 20, steps_total: 28 } });
  assert.equal(node.toma_stats.text, "50% merged · 20/28 steps");
  assert.ok(node.dirty > 0);
  assert.ok(app.graph.dirty > 0);

  node.onDrawForeground(ctx);
  assert.equal(ctx.texts.length, 1);
  assert.equal(ctx.texts[0].text, "50% merged · 20/28 steps");
  assert.ok(ctx.texts[0].y >= node.size[1]);
  assert.equal(ctx.depth, 0);

  node.flags.collapsed = true;
  const ctx2 = new FakeCtx();
  node.onDrawForeground(ctx2);
  assert.deepEqual(ctx2.texts, []);
});

test("messages for nodes inside subgraphs follow the id path", () => {
  const ToMA = hookedType("ToMA");
  const inner = new ToMA(5, "ToMA");
  const outer = new FakeNode(3, "Subgraph", new FakeGraph([inner]));
  app.graph = new FakeGraph([outer]);
  send({ node: "3:5", stats: { ratio: 0.25 } });
  assert.equal(inner.toma_stats.text, "25% merged");
  assert.equal(outer.toma_stats, undefined);
});

test("malformed messages, missing nodes and missing graphs never throw", () => {
  const ToMA = hookedType("ToMA");
  const node = new ToMA(1, "ToMA");
  app.graph = new FakeGraph([node]);
  for (const detail of [null, undefined, 5, "x", [], {}, { node: "1" }, { node: "1", stats: 3 },
    { node: "abc", stats: {} }, { node: "99", stats: { ratio: 0.5 } }, { node: "1:2", stats: {} }]) {
    send(detail);
  }
  assert.equal(node.toma_stats, undefined);

  api.dispatchEvent(new Event("toma.stats")); // no detail at all
  app.graph = null;
  send({ node: "1", stats: { ratio: 0.5 } });
  app.graph = { getNodeById() { throw new Error("boom"); } };
  send({ node: "1", stats: { ratio: 0.5 } });
});

test("stats with nothing to show clear the text", () => {
  const ToMA = hookedType("ToMA");
  const node = new ToMA(2, "ToMA");
  app.graph = new FakeGraph([node]);
  send({ node: "2", stats: { ratio: 0.5 } });
  assert.equal(node.toma_stats.text, "50% merged");
  send({ node: "2", stats: {} });
  assert.equal(node.toma_stats.text, null);
  const ctx = new FakeCtx();
  node.onDrawForeground(ctx);
  assert.deepEqual(ctx.texts, []);
});

test("drawing with a broken context or size does not throw", () => {
  const ToMA = hookedType("ToMA");
  const node = new ToMA(4, "ToMA");
  node.toma_stats = { text: "50% merged" };
  node.onDrawForeground(null);
  node.onDrawForeground({});
  node.size = null;
  node.onDrawForeground(new FakeCtx());
  node.size = new Float32Array([200, 80]);
  const ctx = new FakeCtx();
  node.onDrawForeground(ctx);
  assert.equal(ctx.texts.length, 1);
});

test("long lines wrap to at most two lines within the node width", () => {
  const ToMA = hookedType("ToMA");
  const node = new ToMA(6, "ToMA");
  node.size = [200, 100];
  app.graph = new FakeGraph([node]);
  send({
    node: "6",
    stats: { ratio: 0.5, layers_merged: 60, layers_total: 70, steps_merged: 20, steps_total: 28,
      planning_s: 0.3, sampling_s: 10, note: "a rather long note about what happened" },
  });
  const ctx = new FakeCtx();
  node.onDrawForeground(ctx);
  assert.equal(ctx.texts.length, 2);
  for (const { text } of ctx.texts) assert.ok(text.length * 6 <= 200 - 8, text);
});
