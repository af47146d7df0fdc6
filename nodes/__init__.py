"""ComfyUI glue: the pack's nodes and the model patches they install.

node_spec     -- the nodes as plain data (no ComfyUI import)
toma_node     -- the ToMA and ToMAAdvanced nodes: definitions and what they do
preview_node  -- ToMAPreview, the merge overlay: definition and drawing
speed_check   -- ToMASpeedCheck, time per model call on this machine: definition and timing
v3            -- the V3 node classes ComfyUI loads, built from those definitions (imports
                 ComfyUI's comfy_api: imported only by the pack's comfy_entrypoint)
options       -- widget validation and the skip_blocks notation
apply         -- model family detection and patch installation
unet_patch    -- SDXL / SD1.5 / SD2 (ComfyUI's UNet)
unet_neighbours -- other nodes' patches inside UNet blocks, and where ToMA stands aside for them
dit_neighbours -- other nodes that replace a transformer's blocks or patch their self-attention
dit_patch     -- the diffusion transformers (Flux, Wan, HunyuanVideo, Qwen-Image, SD3, ...): one
                 block patch reading the per-family descriptions in dit_families / families/
run_state     -- per-run plans and counters; call_of, the one way a block finds its model call
ui_stats      -- the stats line pushed to the graph
"""

from .node_spec import NodeSpec
from .preview_node import PREVIEW
from .speed_check import SPEED_CHECK
from .toma_node import TOMA, TOMA_ADVANCED

# Every node of the pack by its id, in the order ComfyUI lists them.
NODE_SPECS: dict[str, NodeSpec] = {spec.node_id: spec for spec in (TOMA, TOMA_ADVANCED, PREVIEW,
                                                                    SPEED_CHECK)}
