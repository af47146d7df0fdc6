"""Saved workflows store widget values by position: this snapshot fails when a released widget
moves, is renamed, retyped or gets another default. Append new widgets at the end and extend the
snapshot; never edit an existing line.

It reads the nodes' plain definitions (nodes/node_spec.py), which ComfyUI's V3 classes are built
from; tests/integration/test_server.py checks that ComfyUI gets exactly these."""

import inspect
from pathlib import Path

import toma_pack
from toma_pack.nodes import NODE_SPECS

TOMA = [
    ("model", "MODEL", None),
    ("ratio", "FLOAT", 0.5),
    ("tile_count", "INT", 0),
    ("skip_blocks", "STRING", "d0-4, s0-4"),
    ("recompute_every", "INT", 1),
]

SNAPSHOT = {
    "ToMA": TOMA,
    "ToMAAdvanced": TOMA + [
        ("start_percent", "FLOAT", 0.0),
        ("end_percent", "FLOAT", 1.0),
        ("unet_levels", ["auto", "all", "largest"], "auto"),
        ("merge_scope", ["auto", "block", "attention"], "auto"),
        ("region", ["tile", "stripe", "global"], "tile"),
        ("tau", "FLOAT", 1000.0),
        ("unmerge", ["transpose", "pinv"], "transpose"),
        ("batch_policy", ["per_item", "shared"], "per_item"),
        ("verbose", "BOOLEAN", False),
    ],
    "ToMAPreview": [
        ("image", "IMAGE", None),
        ("ratio", "FLOAT", 0.5),
        ("tile_count", "INT", 64),
        ("level", ["16px (SDXL outer, Flux)", "32px (SDXL inner)", "8px (SD1.5 outer)"],
         "16px (SDXL outer, Flux)"),
    ],
    "ToMASpeedCheck": [
        ("model", "MODEL", None),
        ("positive", "CONDITIONING", None),
        ("latent", "LATENT", None),
        ("ratios", "STRING", "0.25, 0.5, 0.75"),
        ("calls", "INT", 3),
    ],
}


DISPLAY_NAMES = {
    "ToMA": "ToMA Token Merge",
    "ToMAAdvanced": "ToMA Token Merge (Advanced)",
    "ToMAPreview": "ToMA Merge Preview",
    "ToMASpeedCheck": "ToMA Speed Check",
}
CATEGORY = "model_patches/ToMA"


def inputs_of(spec) -> list[tuple]:
    return [(name, kind, options.get("default")) for name, (kind, options) in spec.inputs.items()]


def test_released_widgets_never_move():
    for name, expected in SNAPSHOT.items():
        actual = inputs_of(NODE_SPECS[name])
        assert actual[:len(expected)] == expected, name


def test_every_node_is_in_the_snapshot_and_named():
    assert set(NODE_SPECS) == set(SNAPSHOT)
    for node_id, spec in NODE_SPECS.items():
        assert spec.node_id == node_id
        assert spec.display_name == DISPLAY_NAMES[node_id]
        assert spec.category == CATEGORY


def test_the_token_merge_nodes_send_their_stats_to_their_own_id():
    # nodes/ui_stats.py shows the stats on the node ComfyUI names in the hidden unique_id.
    assert NODE_SPECS["ToMA"].hidden == NODE_SPECS["ToMAAdvanced"].hidden == ("unique_id",)
    assert NODE_SPECS["ToMA"].outputs == NODE_SPECS["ToMAAdvanced"].outputs == ("MODEL",)
    assert NODE_SPECS["ToMAPreview"].outputs == ("IMAGE",)


def test_the_pack_is_a_v3_extension():
    # ComfyUI loads V1 mappings in preference to comfy_entrypoint: there must be none.
    assert not hasattr(toma_pack, "NODE_CLASS_MAPPINGS")
    assert not hasattr(toma_pack, "NODE_DISPLAY_NAME_MAPPINGS")
    assert inspect.iscoroutinefunction(toma_pack.comfy_entrypoint)
    web = Path(toma_pack.__file__).parent / toma_pack.WEB_DIRECTORY
    assert web.is_dir(), web


def test_every_input_has_a_tooltip_and_every_node_a_description():
    for name, spec in NODE_SPECS.items():
        assert len(spec.description) > 80, name
        for input_name, (_, options) in spec.inputs.items():
            assert options.get("tooltip"), f"{name}.{input_name} has no tooltip"


def test_defaults_lie_within_their_ranges():
    for name, spec in NODE_SPECS.items():
        for input_name, (kind, options) in spec.inputs.items():
            if isinstance(kind, list):
                assert options["default"] in kind, f"{name}.{input_name}"
            elif "min" in options:
                assert options["min"] <= options["default"] <= options["max"], \
                    f"{name}.{input_name}"
