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
    if pct == 0:
        return "0%"
    if pct < 1:
        return "<1%"
    if round(pct) >= 100 and pct < 100:
        return ">99%"
    return f"{round(pct)}%"


def format_stats(stats: dict) -> str:
    """The text shown on the node, e.g.

        50% merged · 60/70 layers · 20/28 steps · planning 3% of step time
        64x64: 4096 → 2048 tokens · 32x32: 1024 → 512 tokens

    then the run's note on a third line, if any. `stats` is run_state's summary; fields that
    are missing or malformed are left out rather than shown wrong.
    """
    summary = [part for part in (
        _ratio_part(stats.get("ratio")),
        _fraction_part(stats.get("layers_merged"), stats.get("layers_total"), "layers"),
        _fraction_part(stats.get("steps_merged"), stats.get("steps_total"), "steps"),
        _planning_part(stats.get("planning_s"), stats.get("sampling_s")),
    ) if part]
    levels = [_level_part(level) for level in stats.get("levels") or ()]
    lines = [SEPARATOR.join(summary), SEPARATOR.join(part for part in levels if part),
             _note_part(stats.get("note"))]
    return LINE_BREAK.join(line for line in lines if line)


def send_stats(node_id: str | None, stats: dict) -> None:
    """Show format_stats(stats) on node `node_id` (its execution id, "12" or "5:12" inside a
    subgraph) in every connected browser; a no-op without a server (tests, scripts) or
    without a node id (model patched outside a graph)."""
    send_text(node_id, format_stats(stats))


def send_text(node_id: str | None, text: str) -> None:
    """Show `text` on node `node_id` as ComfyUI's progress text (see send_stats)."""
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


def _ratio_part(ratio: object) -> str | None:
    if not _finite(ratio) or not 0 <= ratio <= 1:
        return None
    return f"{format_percent(ratio)} merged"


def _fraction_part(done: object, total: object, unit: str) -> str | None:
    done, total = _count(done), _count(total)
    if done is None:
        return None
    return f"{done}/{total} {unit}" if total else f"{done} {unit}"


def _planning_part(planning_s: object, sampling_s: object) -> str | None:
    if not (_finite(planning_s) and _finite(sampling_s)) or planning_s < 0 or sampling_s <= 0:
        return None
    return f"planning {format_percent(planning_s / sampling_s)} of step time"


def _level_part(level: object) -> str | None:
    if not isinstance(level, dict):
        return None
    tokens, merged = _count(level.get("tokens")), _count(level.get("merged_tokens"))
    if tokens is None or merged is None:
        return None
    return f"{level.get('name') or '?'}: {tokens} → {merged} tokens"


def _note_part(note: object) -> str | None:
    if not isinstance(note, str):
        return None
    note = " ".join(note.split())
    return note if len(note) <= MAX_NOTE_CHARS else note[:MAX_NOTE_CHARS - 1] + "…"
