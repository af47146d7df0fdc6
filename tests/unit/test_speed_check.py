"""ToMASpeedCheck's own logic: reading the ratios widget, the table and the chart.

Timing through ComfyUI's sampler is tests/integration/test_speed_check.py; the node in a real
server and frontend is test_server.py and test_frontend.py.
"""

from __future__ import annotations

import pytest
import torch

from toma_pack.nodes.speed_check import Timing, chart, format_results, parse_ratios
from toma_pack.nodes.ui_stats import LINE_BREAK


def test_ratios_are_read_from_commas():
    assert parse_ratios("0.25, 0.5;0.75,") == [0.25, 0.5, 0.75]
    assert parse_ratios("") == []


@pytest.mark.parametrize("text", ["0.5, fast", "1.5", "nan", "-0.1"])
def test_unreadable_ratios_name_the_widget(text):
    with pytest.raises(ValueError, match="ratio"):
        parse_ratios(text)


ROWS = [Timing("unmerged", 0.200),
        Timing("ToMA 0.5 (connected)", 0.100, 0.0421, {"layers_merged": 12, "layers_total": 36}),
        Timing("ToMA 0.9", 0.250, 0.0, {"layers_merged": 0, "layers_total": 36,
                                        "note": "nothing merged: no layer had enough tokens"})]


def test_text_gives_speed_up_time_layers_and_change_toma_first():
    assert format_results(ROWS).split(LINE_BREAK) == [
        "ToMA 0.5 (connected): 2.00x · 100.0 ms a call · 12/36 layers · output moved 0.042",
        "ToMA 0.9: 0.80x · 250.0 ms a call · 0/36 layers · output moved 0.000",
        "unmerged: 1.00x · 200.0 ms a call",
        # A variant that merged nothing says why, after the rows.
        "ToMA 0.9: nothing merged: no layer had enough tokens"]


def test_chart_has_one_bar_per_variant():
    image = chart(ROWS)
    assert image.shape[0] == 1 and image.shape[2] == 512 and image.shape[3] == 3
    assert 0 <= float(image.min()) and float(image.max()) <= 1
    # Bars are drawn in blue (ToMA) and grey (unmerged): the longest bar is the 2x one.
    blue = (image[0, :, :, 2] > 0.7) & (image[0, :, :, 0] < 0.3)
    rows = blue.any(dim=1).nonzero().flatten()
    assert len(rows) > 0
    widths = [int(blue[int(y)].sum()) for y in (rows.min(), rows.max())]
    assert widths[0] > widths[1] > 0, widths
    assert torch.isfinite(image).all()
