"""Saved workflows store widget values by position: this snapshot fails when a released widget
moves, is renamed, retyped or gets another default. Append new widgets at the end and extend the
snapshot; never edit an existing line."""

from toma_pack.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

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
}


def inputs_of(node_class) -> list[tuple]:
    spec = node_class.INPUT_TYPES()
    rows = []
    for section in ("required", "optional"):
        for name, (kind, *rest) in spec.get(section, {}).items():
            options = rest[0] if rest else {}
            rows.append((name, kind, options.get("default")))
    return rows


def test_released_widgets_never_move():
    for name, expected in SNAPSHOT.items():
        actual = inputs_of(NODE_CLASS_MAPPINGS[name])
        assert actual[:len(expected)] == expected, name


def test_every_node_is_in_the_snapshot_and_named():
    assert set(NODE_CLASS_MAPPINGS) == set(SNAPSHOT)
    assert set(NODE_DISPLAY_NAME_MAPPINGS) == set(SNAPSHOT)


def test_every_input_has_a_tooltip_and_every_node_a_description():
    for name, node_class in NODE_CLASS_MAPPINGS.items():
        assert len(node_class.DESCRIPTION) > 80, name
        for section in ("required", "optional"):
            for input_name, (_, *rest) in node_class.INPUT_TYPES().get(section, {}).items():
                assert rest and rest[0].get("tooltip"), f"{name}.{input_name} has no tooltip"


def test_defaults_lie_within_their_ranges():
    for name, node_class in NODE_CLASS_MAPPINGS.items():
        for input_name, (kind, *rest) in node_class.INPUT_TYPES()["required"].items():
            options = rest[0] if rest else {}
            if isinstance(kind, list):
                assert options["default"] in kind, f"{name}.{input_name}"
            elif "min" in options:
                assert options["min"] <= options["default"] <= options["max"], \
                    f"{name}.{input_name}"
