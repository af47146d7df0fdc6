"""What ToMA needs from ComfyUI, stated per model family as data, and checked against the
ComfyUI that runs when the node patches a model.

A family states one `Contract`: the model classes it patches (each with what models of that
class need besides), what every model of the family needs (`needs`), and the parameters its
blocks' forwards take (`blocks`, read from the model's own blocks). A `Need` names a ComfyUI
object by "module:qualname" and reads it from the code that is loaded:

- Takes: a function's parameters (a block forward's, apply_model's, the sampler's);
- Hands: the arguments ComfyUI's block loop hands a "dit" replace patch (a dict literal);
- Gives: keys a function stores in the dict it builds (conditioning from model_base's
  extra_conds, transformer_options a model sets for its blocks);
- Sets: attributes a function sets on `self`; Has: names a class or module has; Equals: a
  constant's value; Holds: code a function holds (a layout the family reads tensors by);
  Mentions: strings a function or module uses (a marker of a feature);
- JoinOrder: the order a model joins two streams into one sequence, against the flag ToMA
  reads that order from.

A need can apply only from a ComfyUI version on (`since`) or only where another need is met
(`when`: a feature's marker). Where the object's code cannot be read (no source, another
pack's replacement of it) a need is taken as met: the check reports what it can see changed.

`claimed` tells whether a model is of a contract's classes: by identity, or by name (within
ComfyUI's `comfy` package) where that class no longer imports, so that a model of a class that
moved is refused with the reason rather than called unsupported. Classes are imported only
here, each inside a guard: a class that fails to import fails only the models of that class.
What was read is kept for the process: ComfyUI's code does not change while it runs.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, is_dataclass

# ComfyUI's own packages: a model class found by name must come from one of them
COMFY_PACKAGES = ("comfy", "comfy_extras", "comfy_api")


def comfyui_version() -> str:
    """The running ComfyUI's version (comfyui_version.__version__), "unknown" without one."""
    try:
        return str(importlib.import_module("comfyui_version").__version__)
    except Exception:
        return "unknown"


def version_numbers(version: str) -> tuple[int, ...] | None:
    """(major, minor, patch) of a version string, None for "unknown"."""
    numbers = re.findall(r"\d+", version)
    return tuple(int(n) for n in numbers[:3]) if numbers else None


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


@functools.cache
def source_of(obj: object) -> str | None:
    """The source of a ComfyUI function, class or module; None where it cannot be read or the
    object is not ComfyUI's own (another pack's replacement of a function)."""
    target = inspect.unwrap(obj) if callable(obj) else obj
    module = getattr(target, "__name__", "") if inspect.ismodule(target) else \
        getattr(target, "__module__", "") or ""
    if module.split(".")[0] not in COMFY_PACKAGES:
        return None
    try:
        return textwrap.dedent(inspect.getsource(target))
    except (OSError, TypeError):
        return None


@functools.cache
def tree_of(obj: object) -> ast.AST | None:
    """source_of parsed."""
    source = source_of(obj)
    try:
        return None if source is None else ast.parse(source)
    except SyntaxError:
        return None


def _strings(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


# Needs ------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Need:
    """One thing ToMA needs from ComfyUI. since: only from this ComfyUI version on; when: only
    where that need is met; why: what ToMA reads it for (said with the mismatch)."""

    since: str | None = None
    when: Need | None = None
    why: str = ""

    def applies(self, version: str) -> bool:
        """Whether the need is asked of this ComfyUI version (an unknown version: every need
        is)."""
        running, since = version_numbers(version), self.since and version_numbers(self.since)
        if since and running is not None and running < since:
            return False
        return self.when is None or not self.when.problems()

    def problems(self) -> list[str]:
        """What this ComfyUI lacks of the need, each naming the object and what was expected."""
        raise NotImplementedError

    def mismatches(self, version: str) -> tuple[str, ...]:
        """problems(), with why, where the need applies."""
        return _mismatches(self, version)


@functools.cache
def _mismatches(need: Need, version: str) -> tuple[str, ...]:
    if not need.applies(version):
        return ()
    return tuple(f"{problem} ({need.why})" if need.why else problem
                 for problem in need.problems())


@dataclass(frozen=True)
class Takes(Need):
    """`function` takes these parameters (by name)."""

    function: str
    parameters: tuple[str, ...]

    def problems(self) -> list[str]:
        found, why = resolve(self.function)
        if found is None:
            return [why]
        return missing_parameters(found, shown(self.function), self.parameters)


def missing_parameters(function: object, name: str, parameters: Iterable[str]) -> list[str]:
    """What `function` (called `name` in the message) does not take of these parameters."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return []
    kinds = {p.kind for p in params.values()}
    if kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        return []           # a wrapper that passes everything on: nothing to read
    return [f"{name} takes no {p!r}" for p in parameters if p not in params]


@dataclass(frozen=True)
class Hands(Need):
    """The block loop of the model class at `model` (its own, or the nearest base class's that
    has one) hands the replace patches under ("dit", (`key`, i)) a dict holding these
    arguments."""

    model: str
    key: str
    arguments: tuple[str, ...]

    def handed(self, tree: ast.AST) -> list[set[str]]:
        """The keys of each dict a class's source hands `key` replace patches: a dict literal,
        or a name it builds one under (`args = {...}`, `args["img"] = ...`)."""
        out = []
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript)
                    and isinstance(call.func.slice, ast.Tuple) and call.func.slice.elts
                    and _strings(call.func.slice.elts[0])
                    and call.func.slice.elts[0].value == self.key and call.args):
                continue
            handed = call.args[0]
            if isinstance(handed, ast.Dict):
                out.append({k.value for k in handed.keys if _strings(k)})
            elif isinstance(handed, ast.Name):
                out.append(keys_built(tree, handed.id))
        return out

    def problems(self) -> list[str]:
        found, why = resolve(self.model)
        if found is None:
            return [why]
        for cls in inspect.getmro(found) if inspect.isclass(found) else (found,):
            if cls.__module__.split(".")[0] not in COMFY_PACKAGES:
                continue        # torch's classes (the block loops are ComfyUI's)
            tree = tree_of(cls)
            if tree is None:
                return []       # no source to read
            handed = self.handed(tree)
            if handed:
                break
        else:
            return [f"{shown(self.model)} calls no {self.key!r} replace patch"]
        out = []
        for keys in handed:
            out += [f"{shown(self.model)} hands {self.key} patches no {name!r}"
                    for name in self.arguments if name not in keys]
        return list(dict.fromkeys(out))


def keys_built(tree: ast.AST, name: str) -> set[str]:
    """String keys of the dicts a source builds under `name`: assigned as dict literals, or
    stored one by one."""
    keys: set[str] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)):
            keys |= {k.value for k in node.value.keys if _strings(k)}
        elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id == name
              and _strings(node.slice)):
            keys.add(node.slice.value)
    return keys


def stored_keys(tree: ast.AST) -> set[str]:
    """String keys a function stores in dicts: `d["key"] = ...`, `{"key": ...}`,
    `dict(key=...)`, `d.update(key=...)`."""
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


def parsed(path: str) -> tuple[ast.AST | None, list[str]]:
    """(the syntax tree of the object at `path`, []); (None, [why]) where that object is not
    there; (None, []) where its code cannot be read, which counts as met."""
    found, why = resolve(path)
    if found is None:
        return None, [why]
    return tree_of(found), []


@dataclass(frozen=True)
class Gives(Need):
    """`function` stores these keys in the dict it builds; what: what they are, for the
    message ("conditioning", "transformer option")."""

    function: str
    keys: tuple[str, ...]
    what: str = "key"

    def problems(self) -> list[str]:
        tree, missing = parsed(self.function)
        if tree is None:
            return missing
        keys = stored_keys(tree)
        return [f"{shown(self.function)} gives no {key!r} {self.what}" for key in self.keys
                if key not in keys]


@dataclass(frozen=True)
class Sets(Need):
    """`function` (a constructor) sets these attributes on self."""

    function: str
    attributes: tuple[str, ...]

    def problems(self) -> list[str]:
        tree, missing = parsed(self.function)
        if tree is None:
            return missing
        stored = {node.attr for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"}
        return [f"{shown(self.function)} sets no self.{name}" for name in self.attributes
                if name not in stored]


@dataclass(frozen=True)
class Has(Need):
    """The class or module at `path` has these names (a dataclass: these fields)."""

    path: str
    names: tuple[str, ...]

    def problems(self) -> list[str]:
        found, why = resolve(self.path)
        if found is None:
            return [why]
        known = {f.name for f in fields(found)} if is_dataclass(found) else set()
        return [f"{shown(self.path)} has no {name}" for name in self.names
                if name not in known and not hasattr(found, name)]


@dataclass(frozen=True)
class Equals(Need):
    """The constant at `path` is `value`."""

    path: str
    value: object

    def problems(self) -> list[str]:
        found, why = resolve(self.path)
        if found is None:
            return [why]
        return [] if found == self.value else [
            f"{shown(self.path)} is {found!r}, not {self.value!r}"]


def _code(text: str) -> str:
    return re.sub(r"\s+", "", text)


@dataclass(frozen=True)
class Holds(Need):
    """`function` holds these lines of code (whitespace aside): a layout ToMA reads tensors by."""

    function: str
    fragments: tuple[str, ...]

    def problems(self) -> list[str]:
        found, why = resolve(self.function)
        if found is None:
            return [why]
        source = source_of(found)
        if source is None:
            return []
        code = _code(source)
        return [f"{shown(self.function)} no longer holds `{fragment}`"
                for fragment in self.fragments if _code(fragment) not in code]


@dataclass(frozen=True)
class Mentions(Need):
    """The function or module at `path` uses these strings (a marker of a feature)."""

    path: str
    texts: tuple[str, ...]

    def problems(self) -> list[str]:
        tree, missing = parsed(self.path)
        if tree is None:
            return missing
        used = {node.value for node in ast.walk(tree) if _strings(node)}
        return [f"{shown(self.path)} does not mention {text!r}" for text in self.texts
                if text not in used]


@dataclass(frozen=True)
class JoinOrder(Need):
    """`function` joins two streams into one sequence (`target = torch.cat((a, b), ...)`) in
    `order`, or in the reverse order where `model` builds its blocks with `flag=True`; ToMA
    reads the order from that flag on the blocks, which `block`'s constructor must then set."""

    function: str
    target: str
    order: tuple[str, str]
    model: str
    flag: str
    block: str

    def problems(self) -> list[str]:
        found, why = resolve(self.function)
        built, why_model = resolve(self.model)
        if found is None or built is None:
            return [why or why_model]
        tree, model_tree = tree_of(found), tree_of(built)
        if tree is None or model_tree is None:
            return []
        flagged = any(isinstance(k, ast.keyword) and k.arg == self.flag
                      and isinstance(k.value, ast.Constant) and k.value.value is True
                      for k in ast.walk(model_tree))
        expected = self.order[::-1] if flagged else self.order
        joined = [tuple(e.id for e in node.value.args[0].elts) for node in ast.walk(tree)
                  if isinstance(node, ast.Assign) and len(node.targets) == 1
                  and isinstance(node.targets[0], ast.Name) and node.targets[0].id == self.target
                  and isinstance(node.value, ast.Call) and node.value.args
                  and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "cat"
                  and isinstance(node.value.args[0], (ast.Tuple, ast.List))
                  and all(isinstance(e, ast.Name) for e in node.value.args[0].elts)
                  and set(e.id for e in node.value.args[0].elts) == set(self.order)]
        flag = f"{shown(self.model)} {'sets' if flagged else 'does not set'} {self.flag}"
        if not joined:
            return [f"{shown(self.function)} no longer joins {' and '.join(self.order)} "
                    f"with torch.cat ({flag})"]
        out = [f"{shown(self.function)} joins {self.target} as ({', '.join(order)}), where "
               f"ToMA expects ({', '.join(expected)}): {flag}"
               for order in dict.fromkeys(joined) if order != expected]
        if flagged:
            out += Sets(self.block, (self.flag,)).problems()
        return out


# Contracts --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Contract:
    """What one model family needs from ComfyUI.

    label: the family's name in messages; models: each model class it patches
    ("module:qualname") -> what models of that class need besides; needs: what every model of
    the family needs; blocks: the model's block lists (attribute path, as a BlockKind's
    `modules`) -> the parameters their forwards take, checked on the model's own blocks when
    the node patches it."""

    label: str
    models: dict[str, tuple[Need, ...]]
    needs: tuple[Need, ...] = ()
    blocks: dict[str, tuple[str, ...]] = field(default_factory=dict)


def claimed(contract: Contract, diffusion_model: object) -> str | None:
    """The contract's model class (its path) the model is of: by identity, or by name where
    that class does not import (a moved class); None when it is of none."""
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
    found: list[str] = []
    if model is not None:
        why = resolve(model)[1]
        found += [why] if why else []
    for need in (*contract.needs, *(contract.models.get(model, ()) if model else ())):
        found += need.mismatches(version)
    if diffusion_model is not None:
        found += block_mismatches(contract.blocks, diffusion_model)
    return list(dict.fromkeys(found))


def block_mismatches(blocks: dict[str, tuple[str, ...]], diffusion_model: object) -> list[str]:
    """What a model's block lists lack: the list itself, or parameters of its blocks'
    forwards (each kind of block in the list: compiled blocks are read through their
    wrapper)."""
    found: list[str] = []
    for path, parameters in blocks.items():
        try:
            listed = functools.reduce(getattr, path.split("."), diffusion_model)
            kinds = {type(getattr(block, "_orig_mod", block)) for block in listed}
        except Exception:
            found.append(f"{type(diffusion_model).__name__} has no {path}")
            continue
        for kind in sorted(kinds, key=lambda k: k.__qualname__):
            found += missing_parameters(kind.forward, f"{kind.__module__}.{kind.__qualname__}"
                                        f".forward", parameters)
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
