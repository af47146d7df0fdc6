"""ComfyUI glue: the pack's nodes and the model patches they install.

toma_node     -- the ToMA and ToMAAdvanced nodes
preview_node  -- ToMAPreview, the merge overlay
options       -- widget validation and the skip_blocks notation
apply         -- model family detection and patch installation
unet_patch    -- SDXL / SD1.5 / SD2 (ComfyUI's UNet)
unet_neighbours -- other nodes' patches inside UNet blocks, and where ToMA stands aside for them
dit_patch     -- the diffusion transformers (Flux, Wan, HunyuanVideo, Qwen-Image, SD3, ...): one
                 block patch reading the per-family descriptions in dit_families / families/
flux_patch    -- Flux double blocks in merge scope "attention"
run_state     -- per-run plans and counters, the model call in flight on each thread
ui_stats      -- the stats line pushed to the graph
"""

from .preview_node import ToMAPreview
from .toma_node import ToMA, ToMAAdvanced

NODE_CLASS_MAPPINGS = {
    "ToMA": ToMA,
    "ToMAAdvanced": ToMAAdvanced,
    "ToMAPreview": ToMAPreview,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "ToMA": "ToMA Token Merge",
    "ToMAAdvanced": "ToMA Token Merge (Advanced)",
    "ToMAPreview": "ToMA Merge Preview",
}
