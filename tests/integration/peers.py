"""Other node packs, loaded the way ComfyUI loads a custom node folder, for the composition tests.

../shared/peers holds unmodified sources of the packs artists put beside a speed-up node
(its README lists them, their commits and licences). `load(name)` copies one into a temporary
custom_nodes/ folder and imports it with ComfyUI's own `nodes.load_custom_node`, as ComfyUI's
start-up does; its nodes are then those its NODE_CLASS_MAPPINGS registered. A pack that fails to
import (a ComfyUI function it imports is gone in this version) gives the reason ComfyUI logged,
so that a test can hold what happens on each version instead of skipping.

`run_node(cls, **inputs)` calls a node the way ComfyUI's executor calls it: V1 classes through
their FUNCTION, V3 classes through `execute`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib.util
import logging
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import comfy_harness as ch

PEERS = ch.REPO_ROOT.parent / "shared" / "peers"


@dataclass
class Peer:
    """One loaded pack: its node classes by id, or why it did not load."""

    name: str
    nodes: dict[str, type] = field(default_factory=dict)
    error: str | None = None

    @property
    def loaded(self) -> bool:
        return self.error is None

    def node(self, node_id: str) -> type:
        if self.error is not None:
            raise RuntimeError(f"{self.name} did not load: {self.error}")
        return self.nodes[node_id]


_loaded: dict[str, Peer] = {}
_folder: Path | None = None


def custom_nodes() -> Path:
    """This session's temporary custom_nodes/ folder (removed at exit)."""
    global _folder
    if _folder is None:
        _folder = Path(tempfile.mkdtemp(prefix="toma-peers-")) / "custom_nodes"
        _folder.mkdir()
        atexit.register(shutil.rmtree, _folder.parent, True)
    return _folder


def comfy_utils_package() -> None:
    """ComfyUI's top-level `utils` package, as main.py finds it from ComfyUI's folder: here
    ComfyUI's folder comes last on sys.path, and some comfy module puts comfy/ in front, whose
    utils.py would shadow it for packs that import ComfyUI's server."""
    root = ch.ensure_comfy()
    current = sys.modules.get("utils")
    if (root / "utils" / "__init__.py").is_file() and (
            current is None or Path(getattr(current, "__file__", "") or "").parent
            != root / "utils"):
        spec = importlib.util.spec_from_file_location(
            "utils", root / "utils" / "__init__.py",
            submodule_search_locations=[str(root / "utils")])
        module = importlib.util.module_from_spec(spec)
        sys.modules["utils"] = module
        spec.loader.exec_module(module)


class _Failures(logging.Handler):
    """Collects what ComfyUI logs while it imports a custom node folder."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def load(name: str) -> Peer:
    """Peer pack `name` (a folder of ../shared/peers), imported once per session by ComfyUI's
    own loader from a copy in custom_nodes/."""
    if name in _loaded:
        return _loaded[name]
    nodes = ch.comfy_top_level_nodes()
    comfy_utils_package()
    target = custom_nodes() / name
    if not target.exists():
        shutil.copytree(PEERS / name, target)
    before = dict(nodes.NODE_CLASS_MAPPINGS)
    failures = _Failures()
    logging.getLogger().addHandler(failures)
    try:
        ok = asyncio.run(nodes.load_custom_node(str(target)))
    finally:
        logging.getLogger().removeHandler(failures)
    added = {k: v for k, v in nodes.NODE_CLASS_MAPPINGS.items() if before.get(k) is not v}
    error = None
    if not ok:
        lines = [line for m in failures.messages for line in m.splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line.split(":")[0]]
        error = (errors or lines or ["import failed"])[-1].strip()
    _loaded[name] = peer = Peer(name, added, error)
    return peer


def run_node(cls: type, **inputs: Any) -> tuple:
    """The outputs of node class `cls` run as ComfyUI's executor runs it."""
    if hasattr(cls, "define_schema"):
        out = cls.execute(**inputs)
        return tuple(getattr(out, "result", None) or out.args)
    return tuple(getattr(cls(), cls.FUNCTION)(**inputs))


def comfy_node(module: str, node_id: str) -> type:
    """Node class `node_id` of ComfyUI's own comfy_extras.<module> (or nodes.py for "nodes"):
    V1 classes by their name, V3 ones by their schema's node id."""
    if module == "nodes":
        return ch.comfy_top_level_nodes().NODE_CLASS_MAPPINGS[node_id]
    ch.comfy_top_level_nodes()
    extras = importlib.import_module(f"comfy_extras.{module}")
    found = getattr(extras, node_id, None)
    if isinstance(found, type):
        return found
    for value in vars(extras).values():
        if isinstance(value, type) and "define_schema" in vars(value) and \
                value.define_schema().node_id == node_id:
            return value
    raise KeyError(f"no node {node_id} in comfy_extras.{module}")


@contextlib.contextmanager
def attention_lengths() -> Iterator[list[int]]:
    """The query length of every attention call ComfyUI's models make, recorded outside the
    pack: ComfyUI's attention function replaced in every loaded comfy module (as
    comfy_harness.attention_backend swaps backends), other packs' copies of a model's forward
    included, since they call the same function. Lengths of [B, L, H*D] calls and of
    [B, H, L, D] ones (skip_reshape) alike. Inside a compiled model dynamo traces the recorder
    (each length a constant of the graph it traced, appended on every replay)."""
    import comfy.ldm.modules.attention as attention

    lengths: list[int] = []
    names = ("optimized_attention", "optimized_attention_masked")
    current = [getattr(attention, n) for n in names]
    inner = current[0]

    def recording(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # ComfyUI 0.34 and later hand q in an AttentionTensorContainer (read with peek(),
        # which leaves it to the attention function); older versions as a tensor
        seen = q.peek() if hasattr(q, "peek") else q
        lengths.append(int(seen.shape[2] if kwargs.get("skip_reshape") else seen.shape[1]))
        return inner(q, *args, **kwargs)

    replaced: list[tuple[Any, str, Any]] = []
    for module in list(sys.modules.values()):
        module_name = getattr(module, "__name__", "") or ""
        if not (module_name == "comfy" or module_name.startswith("comfy.")):
            continue
        for attr in names:
            value = vars(module).get(attr)
            if any(value is fn for fn in current):
                replaced.append((module, attr, value))
                setattr(module, attr, recording)
    try:
        yield lengths
    finally:
        for module, attr, value in reversed(replaced):
            setattr(module, attr, value)


def counting_calls(module: torch.nn.Module) -> tuple[list[int], Callable[[], None]]:
    """([calls], remove): counts the forward calls of `module` (a block: how often a step
    cache let the model compute)."""
    calls: list[int] = []
    handle = module.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls, handle.remove
