"""What happens when ToMA runs beside other nodes artists put in the same graph: one row per
pack, node and model family, with what the composition tests (tests/integration/test_peer_*.py,
test_lora_fp8.py, test_multigpu.py) found on each ComfyUI version.

The README's and the help pages' compatibility tables are rendered from these rows
(`table_rows`), and tests/unit/test_readme.py holds them equal; the integration tests take their
cases and expected outcomes from the same rows, so a row that stops being true fails there.

Outcomes, per ComfyUI version:
- MERGES: both act: the other node does its work and ToMA's merged blocks run shorter
  sequences, the output within a measured bound of the other node alone.
- UNMERGED: ToMA leaves the model (or the affected blocks) unmerged and says so in the stats
  line, naming the other node.
- PEER_FAILS: the other node fails on this version without ToMA too (its own error).
- NOT_LOADED: the other pack does not import on this version (ComfyUI changed what it imports),
  or this version has no such node.
- NOT_TESTED: no tiny model of the family loads through this node on this version (ComfyUI's
  model detection fixes its widths), so the tests cannot run the pair here.
"""

from __future__ import annotations

from dataclasses import dataclass

MERGES = "merges"
UNMERGED = "unmerged, said"
PEER_FAILS = "fails without ToMA too"
NOT_LOADED = "not available"
NOT_TESTED = "not tested"
VERSIONS = ("v0.3.64", "v0.8.0", "v0.33.0")


@dataclass(frozen=True)
class Row:
    """One composition: `pack` (a folder of ../shared/peers, or "ComfyUI" for core nodes),
    `node` (its node id), `family` (the model, as the tests build it), `outcome` per ComfyUI
    version (VERSIONS order), and what a user should know, in a few words."""

    pack: str
    node: str
    family: str
    outcome: tuple[str, str, str]
    note: str = ""

    def on(self, version: str) -> str:
        """The outcome on ComfyUI `version` ("v0.8.0")."""
        return self.outcome[VERSIONS.index(version)]


def every(outcome: str) -> tuple[str, str, str]:
    return (outcome, outcome, outcome)


OLDEST_ONLY = (MERGES, NOT_LOADED, NOT_LOADED)
NEWEST_ONLY = (NOT_LOADED, NOT_LOADED, MERGES)
NEWEST_ONLY_TESTED = (NOT_TESTED, NOT_TESTED, MERGES)

ROWS: tuple[Row, ...] = (
    # Step caches: both act where their copy of the model's forward runs; they skip steps, ToMA
    # merges inside the steps they compute.
    Row("ComfyUI-TeaCache", "TeaCache", "flux", OLDEST_ONLY),
    Row("ComfyUI-TeaCache", "TeaCache", "wan21_t2v", OLDEST_ONLY),
    Row("ComfyUI-TeaCache", "TeaCache", "hidream", OLDEST_ONLY),
    Row("ComfyUI-TeaCache", "TeaCache", "lumina2", OLDEST_ONLY),
    Row("ComfyUI-TeaCache", "TeaCache", "ltxv", OLDEST_ONLY),
    Row("ComfyUI-TeaCache", "TeaCache", "hunyuan_video", (PEER_FAILS, NOT_LOADED, NOT_LOADED),
        "TeaCache's HunyuanVideo forward takes other arguments than ComfyUI's"),
    Row("ComfyUI-MagCache", "MagCache", "flux", OLDEST_ONLY),
    Row("ComfyUI-MagCache", "MagCache", "flux_kontext", OLDEST_ONLY),
    Row("ComfyUI-MagCache", "MagCache", "wan21_t2v", OLDEST_ONLY),
    Row("ComfyUI-MagCache", "MagCache", "wan_vace", OLDEST_ONLY),
    Row("ComfyUI-MagCache", "MagCache", "hunyuan_video", OLDEST_ONLY),
    Row("ComfyUI-MagCache", "MagCache", "hunyuan_video15", every(NOT_LOADED),
        "MagCache imports only where ComfyUI has no HunyuanVideo 1.5"),
    Row("ComfyUI-MagCache", "MagCache", "chroma", (PEER_FAILS, NOT_LOADED, NOT_LOADED)),
    Row("ComfyUI-MagCache", "MagCache", "qwen_image", (PEER_FAILS, NOT_LOADED, NOT_LOADED)),
    Row("Comfy-WaveSpeed", "ApplyFBCacheOnModel", "flux", (MERGES, MERGES, PEER_FAILS),
        "First Block Cache's Flux forward predates ComfyUI 0.33's"),
    Row("Comfy-WaveSpeed", "ApplyFBCacheOnModel", "sdxl", every(MERGES)),
    Row("Comfy-WaveSpeed", "ApplyFBCacheOnModel", "ltxv", every(UNMERGED),
        "First Block Cache runs the blocks as one module of its own"),
    Row("Comfy-WaveSpeed", "ApplyFBCacheOnModel", "hunyuan_video", every(UNMERGED),
        "First Block Cache runs the blocks as one module of its own"),
    # KJNodes' model patches that run without CUDA-only packages.
    Row("ComfyUI-KJNodes", "TorchCompileModelFluxAdvancedV2", "flux", every(MERGES)),
    Row("ComfyUI-KJNodes", "TorchCompileModelWanVideoV2", "wan21_t2v", every(MERGES)),
    Row("ComfyUI-KJNodes", "TorchCompileModelAdvanced", "wan21_t2v", every(MERGES)),
    Row("ComfyUI-KJNodes", "PatchModelPatcherOrder", "flux", every(MERGES)),
    Row("ComfyUI-KJNodes", "ModelPatchTorchSettings", "flux", every(MERGES)),
    Row("ComfyUI-KJNodes", "WanVideoNAG", "wan21_t2v", every(MERGES)),
    Row("ComfyUI-KJNodes", "WanChunkFeedForward", "wan21_t2v", every(MERGES)),
    Row("ComfyUI-KJNodes", "ApplyRifleXRoPE_WanVideo", "wan21_t2v", every(MERGES)),
    Row("ComfyUI-KJNodes", "WanVideoEnhanceAVideoKJ", "wan21_t2v", every(UNMERGED),
        "its blocks run unmerged: it reads the tokens as whole frames"),
    Row("ComfyUI-KJNodes", "SkipLayerGuidanceWanVideo", "wan21_t2v", every(PEER_FAILS),
        "it asks for KJNodes' own TeaCache"),
    # Loading models as artists do: quantized GGUF, fp8 weights, LoRAs.
    Row("ComfyUI-GGUF", "UnetLoaderGGUF", "wan21_t2v", every(MERGES), "Q8_0 and F16"),
    Row("ComfyUI-GGUF", "UnetLoaderGGUF", "sd3", every(MERGES), "Q8_0 and F16"),
    Row("ComfyUI-GGUF", "UnetLoaderGGUF", "flux", NEWEST_ONLY_TESTED, "Q8_0 and F16"),
    Row("ComfyUI-GGUF", "UnetLoaderGGUF", "qwen_image", every(NOT_TESTED)),
    Row("ComfyUI", "UNETLoader (fp8_e4m3fn)", "wan21_t2v", every(MERGES)),
    Row("ComfyUI", "UNETLoader (fp8_e4m3fn)", "sd3", every(MERGES)),
    Row("ComfyUI", "UNETLoader (fp8_e4m3fn)", "flux", NEWEST_ONLY_TESTED),
    Row("ComfyUI", "LoraLoaderModelOnly", "sdxl", every(MERGES), "before or after ToMA"),
    Row("ComfyUI", "LoraLoaderModelOnly", "flux", every(MERGES), "before or after ToMA"),
    Row("ComfyUI", "LoraLoaderModelOnly", "wan21_t2v", every(MERGES), "before or after ToMA"),
    Row("ComfyUI", "LoraLoaderModelOnly + TorchCompileModel", "sdxl", every(MERGES),
        "a LoRA strength changed between runs of the compiled model"),
    # ComfyUI's own multi-GPU nodes (0.33): each device runs its own copy of the model.
    Row("ComfyUI", "MultiGPU_WorkUnits", "sdxl", NEWEST_ONLY, "cond and uncond on two devices"),
    Row("ComfyUI", "SelectModelDevice", "sdxl", NEWEST_ONLY),
)


def table_rows() -> list[str]:
    """The compatibility table's Markdown rows (header included): one per pack and what happens
    on each version, its nodes with the models they were tested on."""
    lines = ["| node pack | nodes (models) | ComfyUI v0.3.64 | v0.8.0 | v0.33.0 | note |",
             "|---|---|---|---|---|---|"]
    groups: dict[tuple[str, tuple[str, str, str], str], dict[str, list[str]]] = {}
    for row in ROWS:
        nodes = groups.setdefault((row.pack, row.outcome, row.note), {})
        nodes.setdefault(row.node, []).append(FAMILY_NAMES[row.family])
    for (pack, outcome, note), nodes in groups.items():
        tested = "; ".join(f"{node} ({', '.join(models)})" for node, models in nodes.items())
        lines.append(f"| {pack} | {tested} | {' | '.join(outcome)} | {note} |")
    return lines


# How the README names the tests' model families.
FAMILY_NAMES = {
    "flux": "Flux", "flux_kontext": "Flux Kontext", "hunyuan_video15": "HunyuanVideo 1.5",
    "sdxl": "SDXL", "wan21_t2v": "Wan 2.1", "wan_vace": "Wan VACE",
    "hidream": "HiDream-I1", "lumina2": "Lumina 2", "ltxv": "LTX-Video",
    "hunyuan_video": "HunyuanVideo", "chroma": "Chroma", "qwen_image": "Qwen-Image",
    "sd3": "SD3", "sd15": "SD1.5",
}
