"""The stats text shown on the ToMA node after a run, and how it reaches ComfyUI's server.

The browser side (the text visible on the node) is tests/integration/test_frontend.py; the
server side (the binary progress-text message) is tests/integration/test_server.py.
"""

from __future__ import annotations

import math
import sys
import types

import pytest

from toma_pack.nodes import ui_stats
from toma_pack.nodes.ui_stats import LINE_BREAK, format_percent, format_stats

STATS = {"ratio": 0.5, "family": "unet", "layers_merged": 60, "layers_total": 70,
         "steps_merged": 20, "steps_total": 28, "planning_s": 0.3, "sampling_s": 10.0,
         "levels": [{"name": "128x128", "tokens": 16384, "merged_tokens": 8192},
                    {"name": "64x64", "tokens": 4096, "merged_tokens": 2048}]}


def lines(text: str) -> list[str]:
    return text.split(LINE_BREAK)


def test_a_run_reads_as_summary_then_levels():
    assert lines(format_stats(STATS)) == [
        "50% merged · 60/70 layers · 20/28 steps · planning 3% of step time",
        "128x128: 16384 → 8192 tokens · 64x64: 4096 → 2048 tokens",
    ]


def test_the_note_gets_its_own_line_whitespace_folded_and_shortened():
    assert lines(format_stats({**STATS, "note": "  nothing\n merged "}))[-1] == "nothing merged"
    long = format_stats({"note": "x" * 500})
    assert len(long) == ui_stats.MAX_NOTE_CHARS and long.endswith("…")


@pytest.mark.parametrize(("fraction", "text"), [
    (0.0, "0%"), (0.004, "<1%"), (0.01, "1%"), (0.333, "33%"), (0.996, ">99%"), (1.0, "100%"),
    (-0.1, None), (math.nan, None), (math.inf, None), (True, None), ("0.5", None)])
def test_percent(fraction, text):
    assert format_percent(fraction) == text


def test_malformed_fields_are_left_out_not_shown_wrong():
    stats = {"ratio": 1.5, "layers_merged": -1, "layers_total": 3, "steps_merged": 2,
             "steps_total": 0, "planning_s": 1.0, "sampling_s": 0.0,
             "levels": [{"name": "a", "tokens": None, "merged_tokens": 3}, "junk"], "note": 5}
    assert format_stats(stats) == "2 steps"
    assert format_stats({}) == ""


class FakeServer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def send_progress_text(self, text: str, node_id: str) -> None:
        self.sent.append((text, node_id))


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> FakeServer:
    """ComfyUI's `server` module as the pack sees it inside ComfyUI: PromptServer.instance."""
    fake = FakeServer()
    module = types.ModuleType("server")
    module.PromptServer = types.SimpleNamespace(instance=fake)
    monkeypatch.setitem(sys.modules, "server", module)
    return fake


def test_stats_go_to_the_node_as_progress_text(server: FakeServer):
    ui_stats.send_stats(7, STATS)
    assert server.sent == [(format_stats(STATS), "7")]


def test_nothing_is_sent_without_a_node(server: FakeServer):
    ui_stats.send_stats(None, STATS)
    assert server.sent == []


def test_a_failing_server_does_not_fail_the_run(server: FakeServer, monkeypatch, caplog):
    def broken(text: str, node_id: str) -> None:
        raise RuntimeError("socket closed")

    monkeypatch.setattr(server, "send_progress_text", broken)
    ui_stats.send_stats("3", STATS)
    assert "could not show ToMA's text on node 3" in caplog.text
