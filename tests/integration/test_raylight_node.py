"""The ToMA Token Merge (Ray) node with Ray's real actors: a stand-in for raylight's GPU worker
(ray_stand_in.py: raylight's RayWorker needs CUDA and NCCL to start) in Ray worker processes that
never imported the pack, each holding a real ComfyUI ModelPatcher of a tiny Wan model.

What this cannot cover: Ray's GPU actors, NCCL, FSDP; the sequence-parallel merge itself is
tested with raylight's real code in test_sequence_parallel.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import tiny_models
import torch

import comfy_harness as ch
from toma_pack.nodes import raylight_node
from toma_pack.nodes.raylight_node import (
    PACK_DIR,
    PACKAGE,
    RayWorkerWithToMA,
    SamplingWithToMA,
    patch_ray_actors,
)
from toma_pack.nodes.toma_node import patch_model

pytestmark = pytest.mark.newest_tree
HERE = Path(__file__).resolve().parent
FAMILY = "wan21_t2v"
SETTINGS = {"ratio": 0.5, "tile_count": 0, "skip_blocks": "", "recompute_every": 1}


@pytest.fixture(scope="module")
def ray_actors():
    """raylight's RAY_ACTORS with two stand-in workers in Ray's own worker processes (Ray is
    in the newest tree's venv only, where these tests run)."""
    import ray

    ch.ensure_comfy()
    comfy_path = str(ch.comfy_status()[0])
    paths = [str(HERE), comfy_path, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20,
             log_to_driver=True, runtime_env={"env_vars": {
                 "PYTHONPATH": os.pathsep.join(p for p in paths if p),
                 "OMP_NUM_THREADS": "1"}})
    from ray_stand_in import StandInWorker

    worker = ray.remote(StandInWorker)
    workers = [worker.remote(FAMILY) for _ in range(2)]
    yield {"workers": workers}
    ray.shutdown()


def sampling_inputs():
    patcher = tiny_models.tiny_patcher(FAMILY)
    x = tiny_models.inputs(FAMILY, patcher, batch=1, height=8, width=8, frames=3)
    return x.latent, x.positive


def ray_sample(ray_actors: dict) -> list[torch.Tensor]:
    """What raylight's KSampler (Ray) node does: common_ksampler on every worker, then
    (_clear_ray_worker_vram_after_sampling) the first worker's get_parallel_dict."""
    import ray

    latent, positive = sampling_inputs()
    futures = [actor.common_ksampler.remote(0, 2, 1.0, "euler", "normal", positive, positive,
                                            {"samples": latent})
               for actor in ray_actors["workers"]]
    results = ray.get(futures)
    ray.get(ray_actors["workers"][0].get_parallel_dict.remote())
    return [out[0]["samples"] for out in results]


def states(ray_actors: dict) -> list[dict]:
    import ray

    actors = [getattr(a, "_actor", a) for a in ray_actors["workers"]]
    return ray.get([a.state.remote(PACKAGE) for a in actors])


def test_toma_reaches_every_worker_only_while_sampling(ray_actors) -> None:
    """After the node, each worker samples with ToMA (the samples equal ToMA's in this process,
    and differ from the unmerged ones); the function arrives in a worker process that had never
    imported the pack (it imports it there); before and after, the worker's ModelPatcher is the
    one it had, with no ToMA on it; sampling again does the same (nothing piles up)."""
    before = states(ray_actors)
    assert not any(s["pack_imported"] for s in before)
    unmerged = ray_sample(ray_actors)
    wrapped = patch_ray_actors(ray_actors, **SETTINGS)
    assert all(isinstance(w, RayWorkerWithToMA) for w in wrapped["workers"])
    merged = ray_sample(wrapped)
    again = ray_sample(wrapped)
    after = states(ray_actors)
    latent, positive = sampling_inputs()
    local = ch.sample(patch_model(tiny_models.tiny_patcher(FAMILY), **SETTINGS), latent,
                      positive, positive, steps=2, cfg=1.0)
    for m, a, u in zip(merged, again, unmerged, strict=True):
        torch.testing.assert_close(m, local)
        torch.testing.assert_close(a, m)
        assert (m - u).norm() / u.norm() > 0.01
    assert all(s["pack_imported"] for s in after)
    assert [s["model_id"] for s in after] == [s["model_id"] for s in before]
    assert not any(s["toma_wrappers"] for s in after)


def test_ratio_zero_and_the_node_removed_leave_the_workers_alone(ray_actors) -> None:
    """Ratio 0 hands the actors back as they came; the actors themselves never carry ToMA, so
    a graph without the node samples unmerged."""
    assert patch_ray_actors(ray_actors, **{**SETTINGS, "ratio": 0.0}) is ray_actors
    patch_ray_actors(ray_actors, **SETTINGS)
    unmerged = ray_sample(ray_actors)
    latent, positive = sampling_inputs()
    plain = ch.sample(tiny_models.tiny_patcher(FAMILY), latent, positive, positive, steps=2,
                      cfg=1.0)
    for u in unmerged:
        torch.testing.assert_close(u, plain)


def test_a_guider_holding_the_wrapped_actors_travels_as_raylight_sends_it(ray_actors) -> None:
    """raylight's custom samplers send their RAY_GUIDER, which holds RAY_ACTORS, to the actors:
    pickled there, a wrapped actor is the actor itself (its handle), so nothing of the pack
    needs importing to unpickle it."""
    import ray.cloudpickle as pickle

    wrapped = patch_ray_actors(ray_actors, **SETTINGS)
    guider = pickle.loads(pickle.dumps({"ray_actors": wrapped, "type": "basic"}))
    assert [type(a).__name__ for a in guider["ray_actors"]["workers"]] == ["ActorHandle"] * 2


def test_each_gpu_says_what_toma_did(capsys) -> None:
    """After sampling, the actor's remove step prints ToMA's run on that GPU (raylight's
    workers' output reaches the console ComfyUI runs in): its tokens and what they merged to,
    layers and steps merged; and hands back the ModelPatcher ToMA was installed on."""
    patcher = tiny_models.tiny_patcher(FAMILY)
    patched = raylight_node.install_on(patcher, SETTINGS)
    latent, positive = sampling_inputs()
    ch.sample(patched, latent, positive, positive, steps=2, cfg=1.0)
    assert raylight_node.remove_from(patched) is patcher
    assert raylight_node.remove_from(patcher) is patcher
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("[ToMA] GPU") and "48 -> 24 tokens" in line, line
    assert "2/2 layers and 2/2 steps merged" in line, line


def test_bad_input_is_refused_on_the_driver() -> None:
    with pytest.raises(ValueError, match="ray_actors"):
        patch_ray_actors({"workers": []}, **SETTINGS)
    with pytest.raises(ValueError, match="ratio"):
        patch_ray_actors({"workers": [object()]}, **{**SETTINGS, "ratio": 2.0})


@pytest.mark.parametrize("ratio", [0.5, 0.0])
def test_a_model_toma_cannot_patch_is_refused_by_the_node(ray_actors, ratio) -> None:
    """raylight runs Hunyuan3D 2 sequence parallel; ToMA cannot patch it: the node fails with
    the ToMA node's error (naming the model and what is supported), read from the GPU's model,
    at every ratio, instead of sampling unmerged in silence."""
    import ray
    from ray_stand_in import StandInWorker

    actor = ray.remote(StandInWorker).remote("tiny_hunyuan3d")
    with pytest.raises(ValueError, match="Hunyuan3Dv2.*supported"):
        patch_ray_actors({"workers": [actor]}, **{**SETTINGS, "ratio": ratio})
    ray.kill(actor)


@pytest.mark.parametrize(("family", "label"), [
    ("hunyuan_video", "HunyuanVideo"), ("ltxv", "LTX-Video"), ("ltx2", "LTX-2"),
    ("mage_flow", "Mage-Flow"), ("hidream_o1", "HiDream-O1")])
def test_families_raylight_cannot_shard_are_left_alone_by_name(caplog, family, label) -> None:
    """Families whose raylight forward ToMA cannot merge (HunyuanVideo's fails with any block
    patch; the others' split what ToMA's shard plans do not carry, or fail on their own): on a
    ModelPatcher raylight will run sequence parallel, ToMA leaves the model unpatched and says
    why, naming the family and raylight (and patches it as usual without raylight's
    callback)."""
    sys.path.insert(0, os.environ.get("RAYLIGHT_SRC", str(ch.SHARED_TREES.parent / "peers" /
                                                          "raylight" / "src")))
    from comfy.patcher_extension import CallbacksMP
    from raylight.distributed_modules.usp import USPInjectRegistry

    patcher = tiny_models.tiny_patcher(family)
    assert raylight_node.install_on(patcher, SETTINGS) is not patcher
    patcher.add_callback(CallbacksMP.ON_LOAD, USPInjectRegistry.inject)
    with caplog.at_level("WARNING", logger="ToMA"):
        assert raylight_node.install_on(patcher, SETTINGS) is patcher
    assert f"ToMA leaves {label} alone under raylight's sequence parallelism: raylight" in \
        caplog.text


def local_toma() -> torch.Tensor:
    latent, positive = sampling_inputs()
    return ch.sample(patch_model(tiny_models.tiny_patcher(FAMILY), **SETTINGS), latent,
                     positive, positive, steps=2, cfg=1.0)


@pytest.mark.parametrize("failing", [0, 1])
def test_an_install_failure_on_any_gpu_reaches_the_user(ray_actors, failing) -> None:
    """Installing ToMA fails on one GPU (a stand-in failure, as out of memory): the sampler
    node raises it, naming that GPU, every time; nothing sampled anywhere and no GPU keeps
    ToMA (merged everywhere or nowhere). Once the GPU is well, the same node output samples
    merged."""
    import ray

    actors = ray_actors["workers"]
    wrapped = patch_ray_actors(ray_actors, **SETTINGS)
    before = states(ray_actors)
    for _ in range(2):
        ray.get(actors[failing].fail_runs.remote(1))
        with pytest.raises(RuntimeError, match=f"GPU {failing + 1} of 2: RuntimeError: "
                                               "stand-in failure"):
            ray_sample(wrapped)
        after = states(ray_actors)
        assert [s["samplings"] for s in after] == [s["samplings"] for s in before]
        assert not any(s["toma_wrappers"] for s in after)
        assert [s["model_id"] for s in after] == [s["model_id"] for s in before]
    for merged in ray_sample(wrapped):
        torch.testing.assert_close(merged, local_toma())


def test_a_removal_failure_reaches_the_user(ray_actors) -> None:
    """Taking ToMA off a GPU after sampling fails: the sampler node raises it once the sampling
    has returned (at raylight's call after sampling), naming the GPU. The next sampling puts
    that GPU's ModelPatcher back first, and samples as ToMA does, once."""
    import ray

    wrapped = patch_ray_actors(ray_actors, **SETTINGS)
    actors = ray_actors["workers"]
    ray.get(actors[1].fail_runs.remote(1, after=1))        # the install passes, the removal not
    with pytest.raises(RuntimeError, match="taking ToMA off GPU 2 of 2 after sampling failed: "
                                           "RuntimeError: stand-in failure"):
        ray_sample(wrapped)
    assert states(ray_actors)[1]["toma_wrappers"] == 1
    for merged in ray_sample(wrapped):
        torch.testing.assert_close(merged, local_toma())
    assert not any(s["toma_wrappers"] for s in states(ray_actors))


def test_the_pack_need_not_be_on_the_gpus_machine() -> None:
    """An actor whose process cannot see the pack (off sys.path and the working directory, its
    files refused, as on another machine of a Ray cluster): the node's check, install and
    removal run there from the sources shipped with the function, and it samples as ToMA does
    in this process."""
    import ray
    from ray_stand_in import StandInWorker

    actor = ray.remote(StandInWorker).remote(FAMILY, hide=PACK_DIR)
    try:
        assert not ray.get(actor.state.remote(PACKAGE))["pack_imported"]
        with pytest.raises(PermissionError):
            ray.get(actor.model_function_runner_get_values.remote(
                lambda model, path: open(path).read(), f"{PACK_DIR}/__init__.py"))
        wrapped = patch_ray_actors({"workers": [actor]}, **SETTINGS)
        [merged] = ray_sample(wrapped)
        torch.testing.assert_close(merged, local_toma())
        state = ray.get(actor.state.remote(PACKAGE))
        assert state["pack_imported"] and not state["toma_wrappers"]
    finally:
        ray.kill(actor)


def test_an_unknown_gpu_method_is_refused(ray_actors) -> None:
    """A method ToMA does not know (a newer raylight's) is refused loudly, rather than let it
    sample unmerged; a method named like a sampler goes through ToMA; known ones pass."""
    worker = patch_ray_actors(ray_actors, **SETTINGS)["workers"][0]
    with pytest.raises(RuntimeError, match="does not know raylight's GPU method 'render'"):
        worker.render.remote()
    assert isinstance(worker.sample_video, SamplingWithToMA)
    assert isinstance(worker.common_ksampler, SamplingWithToMA)
    assert not isinstance(worker.get_parallel_dict, SamplingWithToMA)
    assert not isinstance(worker.clear_sampling_vram, SamplingWithToMA)
