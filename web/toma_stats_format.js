// ToMA stats formatting: pure helpers, no DOM and no ComfyUI imports.
// SPDX-License-Identifier: GPL-3.0-or-later
//
// ComfyUI loads every .js file in web/ as an extension module; this one only
// exports functions, so loading it that way is harmless.

export const SEPARATOR = " · ";
export const MAX_NOTE_CHARS = 160;
export const TOMA_NODE_TYPES = Object.freeze(["ToMA", "ToMAAdvanced"]);

function isPlainObject(value) {
  return value !== null && typeof value === "object" && !Array.isArray(value);
}

function finiteNumber(value) {
  return typeof value === "number" && Number.isFinite(value) ? value : null;
}

function count(value) {
  const n = finiteNumber(value);
  return n !== null && n >= 0 ? Math.round(n) : null;
}

// "33%" for 0.333; "<1%" / ">99%" instead of a misleading "0%" / "100%".
export function formatPercent(fraction) {
  const f = finiteNumber(fraction);
  if (f === null) return null;
  const pct = f * 100;
  if (pct < 0) return null;
  if (pct === 0) return "0%";
  if (pct < 1) return "<1%";
  const rounded = Math.round(pct);
  if (rounded >= 100 && pct < 100) return ">99%";
  return `${rounded}%`;
}

function ratioPart(stats) {
  const r = finiteNumber(stats.ratio);
  if (r === null || r < -1e-9 || r > 1 + 1e-9) return null;
  const text = formatPercent(Math.min(1, Math.max(0, r)));
  return text === null ? null : `${text} merged`;
}

function fractionPart(done, total, unit) {
  const d = count(done);
  if (d === null) return null;
  const t = count(total);
  if (t === null || t === 0) return `${d} ${unit}`;
  return `${d}/${t} ${unit}`;
}

function planningPart(stats) {
  const planning = finiteNumber(stats.planning_s);
  const sampling = finiteNumber(stats.sampling_s);
  if (planning === null || planning < 0 || sampling === null || sampling <= 0) return null;
  const text = formatPercent(planning / sampling);
  return text === null ? null : `planning ${text} of step time`;
}

function notePart(stats) {
  if (typeof stats.note !== "string") return null;
  const note = stats.note.replace(/\s+/g, " ").trim();
  if (!note) return null;
  return note.length > MAX_NOTE_CHARS ? `${note.slice(0, MAX_NOTE_CHARS - 1)}…` : note;
}

// One line such as "50% merged · 60/70 layers · 20/28 steps · planning 3% of step time".
// Parts whose data is missing or malformed are left out; null when nothing is left
// or when `stats` is not an object.
export function formatStats(stats) {
  if (!isPlainObject(stats)) return null;
  const parts = [
    ratioPart(stats),
    fractionPart(stats.layers_merged, stats.layers_total, "layers"),
    fractionPart(stats.steps_merged, stats.steps_total, "steps"),
    planningPart(stats),
    notePart(stats),
  ].filter((p) => p !== null);
  return parts.length ? parts.join(SEPARATOR) : null;
}

// Per-level detail lines such as "d1: 4096 → 2048 tokens" (for tooltips or logs).
export function formatLevels(stats) {
  if (!isPlainObject(stats) || !Array.isArray(stats.levels)) return [];
  const lines = [];
  for (const level of stats.levels) {
    if (!isPlainObject(level)) continue;
    const name = typeof level.name === "string" && level.name ? level.name : "?";
    const tokens = count(level.tokens);
    const merged = count(level.merged_tokens);
    if (tokens === null && merged === null) continue;
    if (tokens !== null && merged !== null) lines.push(`${name}: ${tokens} → ${merged} tokens`);
    else lines.push(`${name}: ${tokens ?? merged} tokens`);
  }
  return lines;
}

// The node id of a "toma.stats" message as a string, or null.
export function messageNodeId(message) {
  if (!isPlainObject(message)) return null;
  const id = message.node;
  if (typeof id === "number" && Number.isInteger(id) && id >= 0) return String(id);
  if (typeof id === "string" && id.trim() !== "") return id.trim();
  return null;
}

// The stats object of `message` when it is about node `nodeId`, otherwise null.
export function statsForNode(message, nodeId) {
  const id = messageNodeId(message);
  if (id === null || nodeId === null || nodeId === undefined) return null;
  if (id !== String(nodeId).trim()) return null;
  return isPlainObject(message.stats) ? message.stats : null;
}

// Execution ids are "12", or "12:5" / "12:5:3" for nodes inside subgraphs (outer to inner).
// Returns the numeric path, or null when the id is not of that form.
export function nodeIdPath(id) {
  if (typeof id === "number") return Number.isInteger(id) && id >= 0 ? [id] : null;
  if (typeof id !== "string") return null;
  const parts = id.trim().split(":");
  if (!parts.every((p) => /^\d+$/.test(p))) return null;
  const path = parts.map(Number);
  return path.every(Number.isSafeInteger) ? path : null;
}

// Everything the extension needs from a raw message: {id, path, text, stats} or null.
export function parseStatsMessage(message) {
  const id = messageNodeId(message);
  if (id === null) return null;
  const stats = statsForNode(message, id);
  if (stats === null) return null;
  const path = nodeIdPath(id);
  if (path === null) return null;
  return { id, path, text: formatStats(stats), stats };
}

// Shorten `text` with "…" until measure(text) <= maxWidth. `measure` maps a string to a width.
export function fitText(text, maxWidth, measure) {
  if (typeof text !== "string" || !text) return "";
  if (typeof measure !== "function" || !(maxWidth > 0)) return text;
  if (measure(text) <= maxWidth) return text;
  let lo = 0;
  let hi = text.length;
  while (lo < hi) {
    const mid = Math.ceil((lo + hi) / 2);
    if (measure(`${text.slice(0, mid)}…`) <= maxWidth) lo = mid;
    else hi = mid - 1;
  }
  return lo > 0 ? `${text.slice(0, lo).trimEnd()}…` : "";
}

// Break a formatted stats line into at most `maxLines` lines no wider than `maxWidth`,
// breaking only at the " · " separators; the last line is shortened with "…" if needed.
export function layoutLines(text, maxWidth, measure, maxLines = 2) {
  if (typeof text !== "string" || !text) return [];
  if (typeof measure !== "function" || !(maxWidth > 0)) return [text];
  const limit = Math.max(1, Math.floor(maxLines) || 1);
  const parts = text.split(SEPARATOR);
  const lines = [];
  let current = "";
  for (let i = 0; i < parts.length; i++) {
    const candidate = current ? current + SEPARATOR + parts[i] : parts[i];
    if (!current || measure(candidate) <= maxWidth) {
      current = candidate;
      continue;
    }
    if (lines.length === limit - 1) {
      // No room for another line: put the rest here and shorten it.
      current = [current, ...parts.slice(i)].join(SEPARATOR);
      break;
    }
    lines.push(current);
    current = parts[i];
  }
  if (current) lines.push(current);
  return lines.map((line) => fitText(line, maxWidth, measure)).filter((line) => line);
}
