"""Runs and model calls keep their own state: two threads sampling clones of ToMA models at the
same moment (as ComfyUI v0.33 evaluates cond batches in a thread pool, one thread per GPU) get
exactly what each gets sampled alone. Real comfy.sample path on the tiny Flux."""

from __future__ import annotations

import threading

import pytest
import torch

import comfy_harness as ch
from toma_pack.nodes.apply import apply_toma
from toma_pack.nodes.options import make_options

TEXT_TOKENS = 16


def lockstep(model, barrier: threading.Barrier):
    """A "dit" patch on double block 0 (after ToMA's, so around it) that waits for the other
    thread at every model call: the two runs interleave call by call."""
    previous = model.model_options["transformer_options"]["patches_replace"]["dit"][
        ("double_block", 0)]

    def patch(args: dict, extra: dict) -> dict:
        barrier.wait(timeout=60)
        return previous(args, extra)

    model.set_model_patch_replace(patch, "dit", "double_block", 0)
    return model


def job(model, latent_hw: tuple[int, int], seed: int) -> callable:
    """A sampling call of `model`, its noise drawn here: ComfyUI's prepare_noise seeds torch's
    global generator, which two threads drawing at once would share (the KSampler node draws
    it before sampling, on the one thread that runs nodes)."""
    import comfy.sample

    positive, negative = ch.flux_conds(1, TEXT_TOKENS, seed=seed)
    latent = ch.empty_latent(model, 1, *latent_hw)
    noise = comfy.sample.prepare_noise(latent, seed)
    return lambda: comfy.sample.sample(model, noise, 2, 2.0, "euler", "normal", positive,
                                       negative, latent, disable_pbar=True, seed=seed)


@pytest.mark.parametrize("nodes", ["one_node", "two_nodes"])
def test_two_threads_at_once_equal_one_after_another(nodes):
    """one_node: two clones of one ToMA node's model (they share its patch objects) at two
    sizes; two_nodes: clones of two ToMA nodes with different ratios."""
    base = ch.tiny_flux_patcher()
    first = apply_toma(base, make_options(0.5, skip_blocks="none"))
    second = first if nodes == "one_node" else apply_toma(
        base, make_options(0.25, skip_blocks="none"))
    sizes = [(16, 20), (12, 14)]
    alone = [job(m.clone(), size, seed)() for m, size, seed in
             zip((first, second), sizes, (0, 1), strict=True)]

    barrier = threading.Barrier(2)
    jobs = [job(lockstep(m.clone(), barrier), size, seed) for m, size, seed in
            zip((first, second), sizes, (0, 1), strict=True)]
    results: list = [None, None]

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as exc:        # reported below, in the test's thread
            results[i] = exc
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for got, expected in zip(results, alone, strict=True):
        assert not isinstance(got, BaseException), got
        assert torch.equal(got, expected)
