"""ComfyUI glue: the pack's nodes and the model patches they install (docs/development.md's code
map says which module holds what)."""

from .node_spec import NodeSpec
from .preview_node import PREVIEW
from .speed_check import SPEED_CHECK
from .toma_node import TOMA, TOMA_ADVANCED

# Every node of the pack by its id, in the order ComfyUI lists them.
NODE_SPECS: dict[str, NodeSpec] = {spec.node_id: spec for spec in (TOMA, TOMA_ADVANCED, PREVIEW,
                                                                    SPEED_CHECK)}
