"""Show a run's stats on its ToMA node, as ComfyUI's own progress text.

`PromptServer.send_progress_text(text, node_id)` (ComfyUI 0.3.64 and later) sends a binary
message that every frontend since then shows as a text box inside the node, in the classic
canvas and in Nodes 2.0 mode alike, so the pack needs no frontend code of its own.
"""

from __future__ import annotations

import logging
import math

log = logging.getLogger("ToMA")
SEPARATOR = " · "
MAX_NOTE_CHARS = 160
# Frontend 1.27 shows the text with newlines turned into <br>; later ones render it as
# Markdown, where a line ending in two spaces is a line break (a bare newline is not).
LINE_BREAK = "  \n"


def format_percent(fraction: float) -> str | None:
    """"33%" for 0.333; "<1%" / ">99%" instead of a misleading "0%" / "100%"."""
    if not _finite(fraction) or fraction < 0:
        return None
    pct = fraction * 100
    if 0 < pct < 1:
        return "<1%"
    if pct < 100 <= round(pct):
        return ">99%"
    return f"{round(pct)}%"


def format_stats(stats: dict) -> str:
    """The text shown on the node, e.g.

        50% merged · 60/70 layers · 20/28 steps · planning 3% of step time
        64x64: 4096 → 2048 tokens · 32x32: 1024 → 512 tokens

    then the run's note on a third line, if any. `stats` is run_state's summary; fields that
    are missing or malformed are left out rather than shown wrong.
    """
    summary, levels = [], []
    ratio = stats.get("ratio")
    if _finite(ratio) and 0 <= ratio <= 1:
        summary.append(f"{format_percent(ratio)} merged")
    for unit in ("layers", "steps"):
        done, total = _count(stats.get(f"{unit}_merged")), _count(stats.get(f"{unit}_total"))
        if done is not None:
            summary.append(f"{done}/{total} {unit}" if total else f"{done} {unit}")
    planning_s, sampling_s = stats.get("planning_s"), stats.get("sampling_s")
    if _finite(planning_s) and _finite(sampling_s) and planning_s >= 0 and sampling_s > 0:
        summary.append(f"planning {format_percent(planning_s / sampling_s)} of step time")
    for level in stats.get("levels") or ():
        if isinstance(level, dict):
            tokens, merged = _count(level.get("tokens")), _count(level.get("merged_tokens"))
            if tokens is not None and merged is not None:
                levels.append(f"{level.get('name') or '?'}: {tokens} → {merged} tokens")
    note = stats.get("note")
    note = " ".join(note.split()) if isinstance(note, str) else ""
    if len(note) > MAX_NOTE_CHARS:
        note = note[:MAX_NOTE_CHARS - 1] + "…"
    lines = [SEPARATOR.join(summary), SEPARATOR.join(levels), note]
    return LINE_BREAK.join(line for line in lines if line)


def send_stats(node_id: str | None, stats: dict) -> None:
    """Show format_stats(stats) on node `node_id` (send_text)."""
    send_text(node_id, format_stats(stats))


def send_text(node_id: str | None, text: str) -> None:
    """Show `text` on node `node_id` (its execution id, "12" or "5:12" inside a subgraph) in
    every connected browser, as ComfyUI's progress text; a no-op without a server (tests,
    scripts) or without a node id (model patched outside a graph)."""
    if node_id is None:
        return
    try:
        from server import PromptServer  # ComfyUI's server module, absent outside ComfyUI
    except ImportError:
        return
    instance = getattr(PromptServer, "instance", None)
    if instance is None:
        return
    try:
        instance.send_progress_text(text, str(node_id))
    except Exception:  # showing a result must never fail the run that made it
        log.warning("could not show ToMA's text on node %s", node_id, exc_info=True)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: object) -> int | None:
    return round(value) if _finite(value) and value >= 0 else None
