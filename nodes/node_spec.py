"""The pack's nodes as plain data: id, names, inputs, outputs.

ComfyUI's V3 node classes (nodes/v3.py) are built from these definitions, and they need ComfyUI
to import; the definitions do not, so the unit tests, the benchmarks and the README checks read
the very inputs ComfyUI is given without a ComfyUI. Inputs are written in the notation of
ComfyUI's V1 API and its /object_info: `name: (type, options)`, where the type is an io type
name ("MODEL", "FLOAT", ...) or, for a dropdown, the list of its choices, and the options are
the widget's settings (default, min, max, step, multiline, tooltip).
"""

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
