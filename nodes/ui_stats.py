"""Push a run's stats to the ToMA node in the graph (drawn by web/toma_stats.js)."""

from __future__ import annotations

import logging

log = logging.getLogger("ToMA")
EVENT = "toma.stats"


def send_stats(node_id: str | None, stats: dict) -> None:
    """Send {"node": node_id, "stats": stats} to the frontend; a no-op without a server
    (tests, scripts) or without a node id (model patched outside a graph)."""
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
        instance.send_sync(EVENT, {"node": str(node_id), "stats": stats})
    except Exception:  # the stats line must never fail a finished sampling run
        log.debug("could not send ToMA stats", exc_info=True)
