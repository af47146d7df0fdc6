"""A causal prompt's keys and values kept across a run's steps while ToMA's patches are in place
(a family's `prefix_cache`).

The first call.prompt_length tokens attend causally among themselves only: their keys and values
in every layer depend on the prompt alone. They are kept per run and cond batch (the call's
identity), decided on the host per model call (open_prefix): "cold" until the run holds every
layer's, each layer running the whole sequence and keeping its prompt K, V; then "hot", each
layer running the tokens after the prompt over the kept ones and handing the prompt's rows back
as they came (ComfyUI's loop picks the image rows by their place; no layer reads the prompt's
rows but to make the kept keys and values). All or nothing over the layers: DiTReading.keeps_prompt
says when it applies. Copies are made under kept_allocations(), as they outlive the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .forward_patches import kept_allocations
from .model_call import ModelCall


@dataclass
class PrefixEntry:
    """One cond batch's kept prompt: layer index -> (K, V) [B, H_kv, length, D]."""

    length: int
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def open_prefix(call: ModelCall, depth: int) -> None:
    """Host side, before the model call: hand its blocks this cond batch's entry and whether it
    is complete (all `depth` layers kept: "hot"). A call without cond uuids (not from
    ComfyUI's sampler) or without a causal prompt keeps nothing."""
    length = call.prompt_length
    if length is None or length <= 0 or not call.identity or not call.identity[0]:
        return
    key = ("prefix_cache", call.identity, length)
    with call.run.lock:
        entry = call.run.host_reads.get(key)
        hot = entry is not None and len(entry.kv) == depth
        if not hot:
            entry = call.run.host_reads[key] = PrefixEntry(length)
    call.prompt = (entry, hot)


def prefix_run(call: ModelCall | None, layer: torch.nn.Module, index: int,
               run: Callable[[dict], dict]) -> Callable[[dict], dict]:
    """What runs decoder layer `index` (`layer`) on a block's arguments in this call: the
    arguments of the family's block patch (x [B, L, C], freqs_cis rows [.., L, D],
    attention_mask, optimized_attention) -> {"x": [B, L, C]}. `run` (ComfyUI's own block) where
    the call keeps no prompt."""
    opened = call.prompt if call is not None else None
    if opened is None:
        return run
    entry, hot = opened
    n = entry.length

    def cold(a: dict) -> dict:
        out, present = layer(x=a["x"], attention_mask=a.get("attention_mask"),
                             freqs_cis=a["freqs_cis"],
                             optimized_attention=a["optimized_attention"], past_key_value=())
        k, v, _ = present
        with kept_allocations():
            entry.kv[index] = (k[:, :, :n].clone(memory_format=torch.contiguous_format),
                               v[:, :, :n].clone(memory_format=torch.contiguous_format))
        return {"x": out}

    def warm(a: dict) -> dict:
        x = a["x"]
        after = x[:, n:]
        k, v = entry.kv[index]
        out, _ = layer(x=after, attention_mask=None,
                       freqs_cis=tuple(f[..., n:, :] for f in a["freqs_cis"]),
                       optimized_attention=a["optimized_attention"], past_key_value=(k, v, n))
        # ComfyUI's layer writes its output into its input (torch.add(..., out=x)): x then
        # already holds it after the prompt, and no copy is needed
        return {"x": x if out is after else torch.cat((x[:, :n], out), dim=1)}

    return warm if hot else cold
