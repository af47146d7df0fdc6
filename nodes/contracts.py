"""What ToMA needs from ComfyUI, stated per model family as data (a `Contract`), and checked
against the running ComfyUI when the node patches a model (what was read is kept: ComfyUI's
code does not change while it runs).

A `Need` names a ComfyUI object by "module:qualname" (its `path`) and checks what it does where
a small call can show it, else the names its code uses, never a line's text: a re-spelling that
keeps the behaviour meets every need (tests/integration/test_contract_faults.py), and so does
code that cannot be read (no source, another pack's replacement). Classes are imported only
here, each inside a guard: one that fails to import fails only its own models (`claimed`).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields, is_dataclass

# ComfyUI's own packages: a model class found by name must come from one of them
COMFY_PACKAGES = ("comfy", "comfy_extras", "comfy_api")


def comfyui_version() -> str:
    """The running ComfyUI's version (comfyui_version.__version__), "unknown" without one."""
    try:
        return str(importlib.import_module("comfyui_version").__version__)
    except Exception:
        return "unknown"


def shown(path: str) -> str:
    """A "module:qualname" path as a message writes it (dotted)."""
    return path.replace(":", ".")


@functools.cache
def resolve(path: str) -> tuple[object, str | None]:
    """(the object at "module:qualname", None), or (None, why it is not there)."""
    module_name, _, qualname = path.partition(":")
    try:
        found: object = importlib.import_module(module_name)
    except Exception as error:
        return None, f"{module_name} does not import ({type(error).__name__}: {error})"
    reached = module_name
    for part in qualname.split(".") if qualname else ():
        try:
            found = getattr(found, part)
        except Exception:
            return None, f"{reached} has no {part}"
        reached = f"{reached}.{part}"
    return found, None


def _own(obj: object) -> tuple[object, str] | None:
    """(the object, its module's name) where it is ComfyUI's own code, else None."""
    target = inspect.unwrap(obj) if callable(obj) else obj
    module = getattr(target, "__name__", "") if inspect.ismodule(target) else \
        getattr(target, "__module__", "") or ""
    return (target, module) if module.split(".")[0] in COMFY_PACKAGES else None


@functools.cache
def tree_of(obj: object) -> ast.AST | None:
    """The syntax tree of a ComfyUI function (its own source), class (found by its qualified
    name in its module's tree) or module; None where it cannot be read or is not ComfyUI's."""
    own = _own(obj)
    if own is None:
        return None
    target, module = own
    if inspect.isfunction(target) or inspect.ismodule(target):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(target)))
        except (OSError, TypeError, SyntaxError):
            return None
        return tree.body[0] if inspect.isfunction(target) else tree
    node = tree_of(sys.modules.get(module))
    for part in getattr(target, "__qualname__", "<none>").split("."):
        # the last definition of a name is the one Python keeps
        found = [child for child in _definitions(getattr(node, "body", ())) if child.name == part]
        node = found[-1] if found else None
    return node


def _definitions(body: Iterable[ast.stmt]) -> Iterator[ast.AST]:
    """The classes and functions a module's or class's body defines, also under if/try."""
    for child in body:
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield child
        elif isinstance(child, (ast.If, ast.Try)):
            for block in (child.body, child.orelse, getattr(child, "finalbody", ()),
                          *(h.body for h in getattr(child, "handlers", ()))):
                yield from _definitions(block)


def _strings(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


# Needs ------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Need:
    """One thing ToMA needs from the ComfyUI object at `path` (each kind's first field), checked
    by the kind's lacks(found). since: only from this ComfyUI version on; when: only where that
    need is met (a feature's marker); why: what ToMA reads it for (said with the mismatch)."""

    since: str | None = None
    when: Need | None = None
    why: str = ""

    def applies(self, version: str) -> bool:
        """Whether the need is asked of this ComfyUI version (of an unknown one: every need)."""
        # (major, minor, patch), () for "unknown" (or no since)
        running, since = (tuple(int(n) for n in re.findall(r"\d+", text)[:3])
                          for text in (version, self.since or ""))
        if since and running and running < since:
            return False
        return self.when is None or not self.when.problems()

    def problems(self) -> list[str]:
        """What this ComfyUI lacks of the need: why the object is not there, or what it lacks."""
        found, why = resolve(self.path)
        return [why] if found is None else self.lacks(found)


@functools.cache
def need_mismatches(need: Need, version: str) -> tuple[str, ...]:
    """need.problems(), with why, where the need applies."""
    if not need.applies(version):
        return ()
    return tuple(f"{problem} ({need.why})" if need.why else problem
                 for problem in need.problems())


@dataclass(frozen=True)
class Names(Need):
    """The object at `path` holds these names: which it holds (`held`; by default those its
    kind's `read` finds in its syntax tree) and how one it lacks is said (`says`)."""

    path: str
    names: tuple[str, ...]

    def lacks(self, found: object) -> list[str]:
        held = self.held(found)
        return [] if held is None else [f"{shown(self.path)} {self.says(name)}"
                                        for name in self.names if name not in held]

    def held(self, found: object) -> set[str] | None:
        """The names `found` holds; None where they cannot be read (the need taken as met)."""
        tree = tree_of(found)
        return None if tree is None else self.read(tree)


class Takes(Names):
    """The function at `path` takes these parameters (by name)."""

    def held(self, found: object) -> set[str] | None:
        try:
            params = inspect.signature(found).parameters
        except (TypeError, ValueError):
            return None
        kinds = {p.kind for p in params.values()}
        if kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
            return None         # a wrapper that passes everything on: nothing to read
        return set(params)

    def says(self, name: str) -> str:
        return f"takes no {name!r}"


@dataclass(frozen=True)
class Hands(Need):
    """The block loop of the model class at `path` (or of its nearest base class with one) hands
    its replace patches under ("dit", (`key`, i)) a dict holding these arguments."""

    path: str
    key: str
    arguments: tuple[str, ...]

    def lacks(self, found: object) -> list[str]:
        for cls in inspect.getmro(found) if inspect.isclass(found) else (found,):
            if cls.__module__.split(".")[0] not in COMFY_PACKAGES:
                continue        # torch's classes (the block loops are ComfyUI's)
            tree = tree_of(cls)
            if tree is None:
                return []       # no source to read
            if handed := handed_dicts(tree, self.key):
                return list(dict.fromkeys(
                    f"{shown(self.path)} hands {self.key} patches no {name!r}"
                    for keys in handed for name in self.arguments if name not in keys))
        return [f"{shown(self.path)} calls no {self.key!r} replace patch"]


def handed_dicts(tree: ast.AST, key: str) -> list[dict[str, ast.expr]]:
    """Each dict a source hands the replace patches under (`key`, i), as its keys -> their
    value expressions: a dict literal or dict(...) call in the call, or a name it builds one
    under (`args = {...}`, `args = dict(...)`, `args["img"] = ...`)."""
    calls = [call for call in ast.walk(tree)
             if isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript)
             and isinstance(call.func.slice, ast.Tuple) and call.func.slice.elts
             and _strings(call.func.slice.elts[0])
             and call.func.slice.elts[0].value == key and call.args]
    return [built(tree, call.args[0].id) if isinstance(call.args[0], ast.Name)
            else dict_items(call.args[0]) or {} for call in calls]


def dict_items(node: ast.AST) -> dict[str, ast.expr] | None:
    """String keys -> value expressions of a dict literal or dict(...) call; None otherwise."""
    if isinstance(node, ast.Dict):
        return {k.value: v for k, v in zip(node.keys, node.values, strict=True) if _strings(k)}
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "dict":
        return {k.arg: k.value for k in node.keywords if k.arg}
    return None


def built(tree: ast.AST, name: str) -> dict[str, ast.expr]:
    """String keys -> value expressions of the dicts a source builds under `name`: assigned
    as dict literals or dict(...) calls, or stored one by one."""
    items: dict[str, ast.expr] = {}
    for node in ast.walk(tree):
        for target in node.targets if isinstance(node, ast.Assign) else ():
            if _name(target) == name:
                items |= dict_items(node.value) or {}
            elif (isinstance(target, ast.Subscript) and _name(target.value) == name
                    and _strings(target.slice)):
                items[target.slice.value] = node.value
    return items


@dataclass(frozen=True)
class Gives(Names):
    """The function at `path` stores these keys in the dict it builds; what: what they are,
    for the message ("conditioning", "transformer option")."""

    what: str = "key"

    def read(self, tree: ast.AST) -> set[str]:
        """String keys stored in dicts: `d["key"] = ...`, `{"key": ...}`, `dict(key=...)`,
        `d.update(key=...)`."""
        keys: set[str] = set()
        for node in ast.walk(tree):
            if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
                    and _strings(node.slice)):
                keys.add(node.slice.value)
            elif isinstance(node, ast.Dict):
                keys |= {k.value for k in node.keys if _strings(k)}
            elif isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else \
                    getattr(node.func, "id", "")
                if name in ("dict", "update"):
                    keys |= {k.arg for k in node.keywords if k.arg}
        return keys

    def says(self, key: str) -> str:
        return f"gives no {key!r} {self.what}"


class Sets(Names):
    """The constructor at `path` sets these attributes on self."""

    def read(self, tree: ast.AST) -> set[str]:
        return {node.attr for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and _name(node.value) == "self"}

    def says(self, name: str) -> str:
        return f"sets no self.{name}"


class Has(Names):
    """The class or module at `path` has these names (a dataclass: these fields)."""

    def held(self, found: object) -> set[str]:
        known = {f.name for f in fields(found)} if is_dataclass(found) else set()
        return known | {name for name in self.names if hasattr(found, name)}

    def says(self, name: str) -> str:
        return f"has no {name}"


@dataclass(frozen=True)
class Equals(Need):
    """The constant at `path` is `value`."""

    path: str
    value: object

    def lacks(self, found: object) -> list[str]:
        return [] if found == self.value else [
            f"{shown(self.path)} is {found!r}, not {self.value!r}"]


class Mentions(Names):
    """The function or module at `path` uses these strings (a marker of a feature)."""

    def read(self, tree: ast.AST) -> set[str]:
        return {node.value for node in ast.walk(tree) if _strings(node)}

    def says(self, text: str) -> str:
        return f"does not mention {text!r}"


@dataclass(frozen=True)
class JoinOrder(Need):
    """The function at `path` joins the two streams it hands the double_block patches under
    the keys in `order` into the one sequence it hands the single_block patches under `target`
    (`torch.cat((a, b), ...)` of those tensors, whatever its locals are called), in `order`,
    or in the reverse order where `model` builds its blocks with `flag=True`; ToMA reads the
    order from that flag on the blocks, which `block`'s constructor must then set."""

    path: str
    target: str
    order: tuple[str, str]
    model: str
    flag: str
    block: str

    def lacks(self, found: object) -> list[str]:
        built_by, why = resolve(self.model)
        if built_by is None:
            return [why]
        tree, model_tree = tree_of(found), tree_of(built_by)
        if tree is None or model_tree is None:
            return []
        flagged = any(isinstance(k, ast.keyword) and k.arg == self.flag
                      and isinstance(k.value, ast.Constant) and k.value.value is True
                      for k in ast.walk(model_tree))
        expected = self.order[::-1] if flagged else self.order
        flag = f"{shown(self.model)} {'sets' if flagged else 'does not set'} {self.flag}"
        joined = self.joins(tree)
        if not joined:
            return [f"{shown(self.path)} no longer hands its single_block patches' "
                    f"{self.target!r} as {' and '.join(self.order)} of its double_block "
                    f"patches joined with torch.cat ({flag})"]
        out = [f"{shown(self.path)} joins {self.target} as ({', '.join(order)}), where "
               f"ToMA expects ({', '.join(expected)}): {flag}"
               for order in dict.fromkeys(joined) if order != expected]
        if flagged:
            out += Sets(self.block, (self.flag,)).problems()
        return out

    def joins(self, tree: ast.AST) -> list[tuple[str, ...]]:
        """The orders, as the streams' keys, of each torch.cat of the two streams' tensors
        into the tensor the joined patches get."""
        streams = {_name(v): k for d in handed_dicts(tree, "double_block")
                   for k, v in d.items() if k in self.order and _name(v)}
        targets = {_name(d.get(self.target)) for d in handed_dicts(tree, "single_block")} - {None}
        cats = [node.value.args[0].elts for node in ast.walk(tree)
                if isinstance(node, ast.Assign) and len(node.targets) == 1
                and _name(node.targets[0]) in targets and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr == "cat" and node.value.args
                and isinstance(node.value.args[0], (ast.Tuple, ast.List))]
        orders = [tuple(streams.get(_name(e)) for e in elts) for elts in cats]
        return [keys for keys in orders if sorted(map(str, keys)) == sorted(self.order)]


def _name(node: ast.AST | None) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


@dataclass(frozen=True)
class Probe(Need):
    """The function at `path` does what ToMA reads from it: `check(function)` runs it on a
    small input (a few tensor elements and a bare object for self, no model) and returns what
    it found wrong; a check that raises is a problem too (refusing its family alone)."""

    path: str
    check: Callable[[object], list[str]]

    def lacks(self, found: object) -> list[str]:
        if _own(found) is None:
            return []           # not ComfyUI's own function
        try:
            found_wrong = self.check(found)
        except Exception as error:
            return [f"probing {shown(self.path)} failed ({type(error).__name__}: {error})"]
        return [f"{shown(self.path)} {problem}" for problem in found_wrong]


def bare(cls: type, **attributes: object) -> object:
    """An object of `cls` made without its constructor, holding only these attributes: the
    `self` a probe hands a ComfyUI method (a model class whose constructor builds a model)."""
    obj = cls.__new__(cls)
    for name, value in attributes.items():
        object.__setattr__(obj, name, value)
    return obj


# Contracts --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Contract:
    """What one model family needs from ComfyUI. label: the family's name in messages; models:
    each model class it patches ("module:qualname") -> what its models need besides `needs`,
    what every model needs; blocks: the model's block lists (attribute path, as
    BlockKind.modules) -> the parameters their forwards take, read on the model's own blocks;
    kinds: its BlockKinds, whose arguments each model class's block loop must hand a "dit"
    kind's patches, and an "object" kind's forward take (with its opaque ones)."""

    label: str
    models: dict[str, tuple[Need, ...]]
    needs: tuple[Need, ...] = ()
    blocks: dict[str, tuple[str, ...]] = field(default_factory=dict)
    kinds: tuple = ()

    def __post_init__(self) -> None:
        loops = [kind for kind in self.kinds if kind.hook == "dit"]
        object.__setattr__(self, "models", {
            model: tuple(dict.fromkeys((*(Hands(model, kind.key, kind.arguments)
                                          for kind in loops), *needs)))
            for model, needs in self.models.items()})
        blocks = dict(self.blocks)
        for kind in self.kinds:
            if kind.hook == "object":
                blocks[kind.modules] = tuple(dict.fromkeys(
                    (*blocks.get(kind.modules, ()), *kind.arguments, *kind.opaque)))
        object.__setattr__(self, "blocks", blocks)


def claimed(contract: Contract, diffusion_model: object) -> str | None:
    """The contract's model class (its path) the model is of: by identity, or by name (within
    ComfyUI's packages) where that class does not import, so that a model of a class that moved
    is refused with the reason rather than called unsupported; None when it is of none."""
    cls = type(diffusion_model)
    for path in contract.models:
        if resolve(path)[0] is cls:
            return path
    if cls.__module__.split(".")[0] in COMFY_PACKAGES:
        for path in contract.models:
            if resolve(path)[0] is None and path.rpartition(":")[2] == cls.__name__:
                return path
    return None


def mismatches(contract: Contract, model: str | None = None,
               diffusion_model: object = None) -> list[str]:
    """What the running ComfyUI lacks of `contract` for models of class `model` (its path;
    None: only what every model needs), and (given a model) of its blocks."""
    version = comfyui_version()
    why = model and resolve(model)[1]
    found = [why] if why else []
    for need in (*contract.needs, *contract.models.get(model, ())):
        found += need_mismatches(need, version)
    if diffusion_model is not None:
        found += block_mismatches(contract.blocks, diffusion_model)
    return list(dict.fromkeys(found))


def block_mismatches(blocks: dict[str, tuple[str, ...]], diffusion_model: object) -> list[str]:
    """What a model's block lists lack: the list itself, or parameters of its blocks' forwards
    (each kind of block in the list; compiled blocks read through their wrapper)."""
    found: list[str] = []
    for path, parameters in blocks.items():
        try:
            listed = functools.reduce(getattr, path.split("."), diffusion_model)
            kinds = {type(getattr(block, "_orig_mod", block)) for block in listed}
        except Exception:
            found.append(f"{type(diffusion_model).__name__} has no {path}")
            continue
        for kind in sorted(kinds, key=lambda k: k.__qualname__):
            found += Takes(f"{kind.__module__}:{kind.__qualname__}.forward",
                           parameters).lacks(kind.forward)
    return found


def running_comfyui() -> str:
    """The running ComfyUI as a message names it: "ComfyUI 0.33.0"."""
    version = comfyui_version()
    return "ComfyUI of unknown version" if version == "unknown" else f"ComfyUI {version}"


def refusal(contract: Contract, model_name: str, problems: Iterable[str]) -> str:
    """The node's error for a model of `contract`'s family the running ComfyUI fails."""
    return (f"ToMA cannot patch {model_name} models on {running_comfyui()}: this version "
            f"changed what ToMA's {contract.label} support relies on ({'; '.join(problems)}); "
            f"other model families are not affected")
