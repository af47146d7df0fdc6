"""The pack's nodes as plain data, from which nodes/v3.py builds the V3 classes (tests and
benchmarks read the very inputs ComfyUI gets, without a ComfyUI). An input is written as in
ComfyUI's V1 API and /object_info: `name: (type, options)`, the type an io type name ("MODEL",
"FLOAT", ...) or a dropdown's choices, the options the widget's (default, min, max, step,
multiline, tooltip)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

InputSpec = tuple[str | list[str], dict[str, Any]]


@dataclass(frozen=True)
class NodeSpec:
    """One node. `inputs` are in widget order: saved workflows store widget values by position,
    so an input is never moved, renamed or retyped, and new ones go at the end
    (tests/unit/test_node_inputs.py holds the snapshot). `hidden` names the values ComfyUI
    passes besides the inputs (io.Hidden members, e.g. "unique_id")."""

    node_id: str
    display_name: str
    category: str
    description: str
    inputs: Mapping[str, InputSpec]
    outputs: tuple[str, ...]
    hidden: tuple[str, ...] = ()

    def defaults(self) -> dict[str, Any]:
        """The default value of every input that has one (the widgets), by name."""
        return {name: options["default"] for name, (_, options) in self.inputs.items()
                if "default" in options}
