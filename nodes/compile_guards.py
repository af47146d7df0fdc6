"""torch.compile without guards: telling such a compile apart, and the guarded globals through
which ToMA's blocks read what the host decided while dynamo traces them."""

from __future__ import annotations


def unguarded_compile(model_options: dict) -> bool:
    """Whether the model runs through a torch.compile wrapper that drops dynamo's guards on
    transformer_options (ComfyUI's TorchCompileModel from 0.8, KJNodes' compile nodes), which
    would fix what ToMA decides per call in its first trace. The guard filter is read from the
    compiled modules the APPLY_MODEL wrappers hold (torch.compile takes it out of the
    "torch_compile_kwargs" these leave in the options); without any, a compile with options is
    taken as unguarded (ComfyUI's node passes its filter there; v0.3.64's keeps every guard)."""
    kwargs = model_options.get("torch_compile_kwargs")
    if not isinstance(kwargs, dict):
        return False
    import torch._dynamo.eval_frame as eval_frame
    from comfy.patcher_extension import WrappersMP, get_all_wrappers

    # in the wrappers' closures or globals, or one level of dicts deep in them
    found: list = []

    def visit(value: object, depth: int = 0) -> None:
        if isinstance(value, eval_frame.OptimizedModule):
            found.append(value)
        elif depth < 2 and hasattr(value, "values") and callable(value.values):
            for item in list(value.values()):
                visit(item, depth + 1)

    for fn in get_all_wrappers(WrappersMP.APPLY_MODEL, model_options, is_model_options=True):
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                visit(cell.cell_contents)
            except ValueError:   # an empty cell
                continue
        code, names = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
        for name in getattr(code, "co_names", ()):
            visit(names.get(name))
    if found:   # each module's guard filter (None: every guard kept)
        hooks = [getattr(getattr(module, "dynamo_ctx", None), "_hooks", None) for module in found]
        return any(getattr(hook, "guard_filter_fn", None) is not None for hook in hooks)
    return kwargs.get("options") is not None


# While a compiled model runs, (node key, device) -> what blocks read of the model call in flight.
# Unlike transformer_options (whose guards ComfyUI's compile drops) a global is guarded, so a call
# that decides otherwise at equal shapes (TRACED_DECISIONS: the node's settings and
# ModelCall.decisions), or whose blocks reuse a plan (TRACED_PLANS: ModelCall.plans; where the
# graph breaks inside the blocks, dynamo compiles one block's code for all of them) gets a trace
# of its own.
TRACED_DECISIONS: dict[tuple[str, str], str] = {}
TRACED_PLANS: dict[tuple[str, str], dict] = {}
