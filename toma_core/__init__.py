"""ToMA (Token Merge with Attention) as plain PyTorch: no ComfyUI import.

regions            -- partition of a token grid into tiles, stripes or one global region
facility_location  -- batched greedy destination selection
merge_plan         -- soft assignment, merge (M x) and unmerge (P^T y), positional rows
plan_cache         -- reuse of plans across layers and sampling steps
"""

from .facility_location import coverage, greedy_facility_location, normalized, similarity
from .merge_plan import (
    BATCH_POLICIES,
    UNMERGE_METHODS,
    MergePlan,
    build_plan,
    destinations_per_region,
)
from .plan_cache import PlanCache, step_index
from .regions import REGION_MODES, Regions, make_regions, tile_grid

__all__ = [
    "BATCH_POLICIES", "REGION_MODES", "UNMERGE_METHODS", "MergePlan", "PlanCache", "Regions",
    "build_plan", "coverage", "destinations_per_region", "greedy_facility_location",
    "make_regions", "normalized", "similarity", "step_index", "tile_grid",
]
