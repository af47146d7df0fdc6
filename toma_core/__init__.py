"""ToMA (Token Merge with Attention) as plain PyTorch: no ComfyUI import.

regions            -- partition of a token grid (tiles, stripes, one region; frame slabs for
                      video) and its index tables on a device
facility_location  -- batched greedy destination selection
plan_op            -- destinations and weights of every region as one operator
triton_plan        -- that operator as one Triton kernel on CUDA
merge_plan         -- merge (M x) and unmerge (U y) as gathers and batched matmuls, positional rows
plan_schedule      -- when plans are due again, on the recompute schedule
attention          -- attention over merged tokens weighted by their sizes, and ToMA around it
"""

from .attention import merged_attention, size_bias
from .facility_location import gram_similarity, greedy_facility_location
from .merge_plan import (
    BATCH_POLICIES,
    UNMERGE_METHODS,
    MergePlan,
    build_plan,
    destinations_per_region,
)
from .plan_schedule import PlanSchedule
from .regions import REGION_MODES, Regions, RegionTables, make_regions, tile_grid

__all__ = [
    "BATCH_POLICIES", "REGION_MODES", "UNMERGE_METHODS", "MergePlan", "PlanSchedule",
    "RegionTables", "Regions", "build_plan", "destinations_per_region", "gram_similarity",
    "greedy_facility_location", "make_regions", "merged_attention", "size_bias", "tile_grid",
]
