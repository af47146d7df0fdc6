"""ToMA (Token Merge with Attention) as plain PyTorch, with no ComfyUI import: what the nodes
use. docs/development.md's code map says what each module holds."""

from .attention import merged_attention, size_bias
from .merge_plan import BATCH_POLICIES, UNMERGE_METHODS, MergePlan, build_plan
from .plan_schedule import PlanSchedule
from .regions import REGION_MODES, Regions, RegionTables, make_regions

__all__ = [
    "BATCH_POLICIES", "REGION_MODES", "UNMERGE_METHODS", "MergePlan", "PlanSchedule",
    "RegionTables", "Regions", "build_plan", "make_regions", "merged_attention", "size_bias",
]
