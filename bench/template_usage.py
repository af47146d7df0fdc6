"""How much of ComfyUI's workflow-template usage runs a model ToMA merges.

    python -m bench.template_usage [--templates DIR] [--out bench/results/NAME.json]

Reads the installed comfyui-workflow-templates package's templates/index.json (each template's
`usage` count) and every template graph beside it (subgraphs included). A template runs a local
diffusion model where its graph has a diffusion loader (LOADERS); the model family comes from
the loaders' file names (FILE_RULES, first match wins; TEMPLATE_RULES, by template name, where
the file is a plain base model run through another model's nodes). The status of a family is
read from the pack: "merges" only where the family's model name is in the pack's supported list
(nodes/families: UNET_MODELS and each family module's MODELS), the refusal reason from a
family's NOT_MERGED where the pack gives one. Templates with no diffusion loader (API nodes, LLMs,
estimators) are counted apart; audio, 3D, upscaler and estimator models are listed but left out
of the image and video total. Stdlib only: the pack's lists are read with `ast`, nothing imported.
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ROOT / "nodes" / "families"
SITE = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / \
    "site-packages"
LOADERS = {"UNETLoader", "CheckpointLoaderSimple", "ImageOnlyCheckpointLoader", "UnetLoaderGGUF"}
COMMAND = "python -m bench.template_usage --out bench/results/2026-12-06-template-usage.json"


@dataclass(frozen=True)
class Rule:
    """A model family: `pack` names it as the pack's supported list does (merges when found
    there, `status` then says what of the variant is untested); otherwise `status` says why it
    does not merge. kind: image/video, audio, 3D,
    upscaler or estimator (only image/video counts in the main total)."""

    family: str
    pack: str = ""
    status: str = ""
    kind: str = "image/video"


def refused(why: str) -> str:
    return f"refused ({why})"


def no_family(cls: str) -> str:
    """A model whose ComfyUI class no family of the pack patches: the node's error names the
    supported models."""
    return refused(f"ComfyUI's {cls}: no family of the pack patches its class")


# (substring of the lower-case model file name, rule): first match wins, so variants come before
# their base model.
FILE_RULES: tuple[tuple[str, Rule], ...] = (
    ("minimax_h3", Rule("MiniMax H3", "MiniMax H3")),
    ("minimax_music", Rule("MiniMax Music 3", status="not an image/video model", kind="audio")),
    ("stable_audio", Rule("Stable Audio", status="not an image/video model", kind="audio")),
    ("stable-audio", Rule("Stable Audio", status="not an image/video model", kind="audio")),
    ("ace_step", Rule("ACE-Step", status="not an image/video model", kind="audio")),
    ("acestep", Rule("ACE-Step", status="not an image/video model", kind="audio")),
    # a 3D shape DiT: the pack's tests check that it is refused
    ("hunyuan3d", Rule("Hunyuan3D 2", status=no_family("Hunyuan3Dv2"), kind="3D")),
    ("hunyuan_3d", Rule("Hunyuan3D 2.1", status=no_family("Hunyuan3Dv2_1"), kind="3D")),
    ("triposplat", Rule("TripoSplat", status=no_family("TripoSplat"), kind="3D")),
    ("seedvr2", Rule("SeedVR2", status=no_family("SeedVR2"), kind="upscaler")),
    ("pid_", Rule("PiD", status=no_family("PiD (a PixelDiT)"), kind="upscaler")),
    ("sam3", Rule("SAM 3", status="not a diffusion model", kind="estimator")),
    ("rt_detr", Rule("RT-DETR", status="not a diffusion model", kind="estimator")),
    ("sdpose", Rule("SDPose", status="a pose estimator, not a generator", kind="estimator")),
    ("lotus", Rule("Lotus depth", status="a depth estimator, not a generator",
                   kind="estimator")),
    # the next three: the pack's NOT_MERGED names their classes and why (read below)
    ("wan_animate_2", Rule("Wan Animate 2", status="WanAnimate2Model")),
    ("s2v", Rule("Wan 2.2 S2V", status="WanModel_S2V")),
    ("humo", Rule("HuMo", status="HumoWanModel")),
    # SCAIL-2: the pack's SCAIL family (tests/integration/test_dit_families.py, wan_scail2)
    ("scail", Rule("SCAIL-2 (Wan 2.1)", "SCAIL")),
    # Wan variants with a class of their own, none of them in the pack's families
    ("causal_forcing", Rule("Causal Forcing (Wan 2.1)", status=no_family("CausalWanModel"))),
    ("dancer", Rule("WanDancer (Wan 2.2)", "WanDancer")),
    # VOID's two passes are CogVideoX models
    ("void_pass", Rule("VOID (CogVideoX)", status=no_family("CogVideoX"))),
    ("bernini", Rule("Bernini-R (Wan 2.2)", "Wan 2.1/2.2")),
    ("vace", Rule("Wan VACE", "VACE")),
    ("fun_control", Rule("Wan Fun control", "Fun control")),
    ("fun_camera", Rule("Wan Fun camera", "camera control")),
    ("chrono_edit", Rule("ChronoEdit (Wan 2.1 image to video)", "Wan 2.1/2.2")),
    ("wan", Rule("Wan 2.1/2.2", "Wan 2.1/2.2")),
    # LTX-2's class (LTXAVModel) with the cross-attention AdaLN
    # (tests/integration/test_ltx23.py)
    ("ltx-2.3", Rule("LTX-2.3", "LTX-2")),
    ("ltx-2.5", Rule("LTX-2.5", "LTX-2")),
    ("ltx-2", Rule("LTX-2", "LTX-2")),
    ("ltx-video", Rule("LTX-Video", "LTX-Video")),
    ("hunyuanvideo1.5", Rule("HunyuanVideo 1.5", "HunyuanVideo 1.0/1.5")),
    ("hunyuan_video", Rule("HunyuanVideo 1.0", "HunyuanVideo 1.0/1.5")),
    ("capybara", Rule("Capybara (HunyuanVideo 1.5's class)", "HunyuanVideo 1.0/1.5")),
    ("kandinsky5", Rule("Kandinsky 5", "Kandinsky 5")),
    ("z_image", Rule("Z-Image", "Z-Image")),
    ("netayume", Rule("NetaYume (Lumina 2)", "Lumina 2")),
    # Lumina 2's class with NewBie's pooled text input (test_newbie_pooled_text_merges)
    ("newbie", Rule("NewBie (Lumina 2's class)", "Lumina 2")),
    ("qwen_image_layered", Rule("Qwen-Image Layered", "Qwen-Image")),
    ("qwen_image", Rule("Qwen-Image (and Edit)", "Qwen-Image")),
    ("firered", Rule("FireRed Image Edit (Qwen-Image-Edit's class)", "Qwen-Image")),
    ("krea2", Rule("Krea 2", "Krea 2")),
    ("ideogram4", Rule("Ideogram 4", "Ideogram 4")),
    ("flux-2", Rule("Flux 2 (Klein)", "Flux 2")),
    ("flux2", Rule("Flux 2", "Flux 2")),
    ("anima", Rule("Anima", "Anima")),
    ("boogu", Rule("Boogu-Image", "Boogu-Image")),
    ("joyai", Rule("JoyAI Image Edit", "JoyImage")),
    ("ernie", Rule("ERNIE-Image", "ERNIE-Image")),
    ("hidream_o1", Rule("HiDream-O1", "HiDream-O1")),
    # HiDream-I1's class, but an edit call: docs/compatibility.md says these run unmerged
    ("hidream_e1", Rule("HiDream-E1", status="runs unmerged (the edit image sits beside the "
                                             "latent in every row of tokens)")),
    ("hidream_i1", Rule("HiDream-I1", "HiDream-I1")),
    ("longcat", Rule("LongCat-Image", "LongCat-Image")),
    ("lens", Rule("Lens", "Lens")),
    ("chroma-radiance", Rule("Chroma Radiance", "Chroma Radiance")),
    ("chroma", Rule("Chroma", "Chroma")),
    ("kontext", Rule("Flux Kontext", "Flux Kontext")),
    ("flux", Rule("Flux.1", "Flux.1 dev/schnell")),
    ("mage_flow", Rule("Mage-Flow", "Mage-Flow")),
    ("sd_xl", Rule("SDXL", "SDXL")),
    ("sd3.5", Rule("SD3.5", "SD3/SD3.5")),
    ("omnigen2", Rule("OmniGen2", "OmniGen2")),
    ("pixeldit", Rule("PixelDiT", status=no_family("PixelDiT"))),
    ("ovis", Rule("Ovis-Image", "Ovis-Image")),
    # Stable Video Diffusion: a video UNet, refused (the pack's tests check it)
    ("svd", Rule("SVD", status=refused("a video UNet: its temporal layers are not patched"))),
)

# (substring of the template name, rule): where the template runs a base model through another
# model's nodes, this rule replaces the base model's.
TEMPLATE_RULES: tuple[tuple[str, Rule], ...] = (
    # WanInfiniteTalkToVideo puts MultiTalk's attention patches in the blocks: those run
    # unmerged (docs/compatibility.md)
    ("infinitetalk", Rule("Wan 2.1 InfiniteTalk", status="runs unmerged (MultiTalk's attention "
                                                         "patches in its blocks)")),
    # AnimaLLLiteApply puts attention patches (per-token control) in Anima's blocks: those run
    # unmerged
    ("anima_lllite", Rule("Anima LLLite", status="runs unmerged (LLLite's attention patches in "
                                                "its blocks)")),
    # USOStyleReference's post-input patch on Flux.1 (test_uso_style_tokens_...never_merge)
    ("uso", Rule("Flux.1 USO", "Flux.1 dev/schnell")),
)


def pack_lists(families: Path = FAMILIES) -> tuple[str, dict[str, str]]:
    """The pack's supported-model list (as supported_models() joins it) and NOT_MERGED (every
    family module's), read from the source of nodes/families without importing it."""
    def constants(path: Path) -> dict[str, ast.expr]:
        return {target.id: node.value for node in ast.parse(path.read_text()).body
                if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Name)}

    names = [ast.literal_eval(constants(families / "__init__.py")["UNET_MODELS"])]
    not_merged: dict[str, str] = {}
    for path in sorted(families.glob("*.py")):
        if path.name != "__init__.py":
            consts = constants(path)
            names.append(ast.literal_eval(consts["MODELS"]))
            not_merged.update(ast.literal_eval(consts.get("NOT_MERGED", ast.Dict([], []))))
    return ", ".join(names), not_merged


def status_of(rule: Rule, supported: str, not_merged: dict[str, str]) -> str:
    """merges / refused (why) / runs unmerged (why) / not ... / unclassified."""
    if rule.pack:
        if rule.pack not in supported:
            return "unclassified (not in the pack's list)"
        return f"merges ({rule.status})" if rule.status else "merges"
    if rule.status in not_merged:
        return refused(not_merged[rule.status])
    return rule.status


def graph_nodes(graph: dict) -> list[dict]:
    """The graph's nodes and those of its subgraphs."""
    nodes = list(graph.get("nodes", []))
    for sub in (graph.get("definitions") or {}).get("subgraphs", []):
        nodes += sub.get("nodes", [])
    return nodes


def model_files(graph: dict) -> list[str]:
    """The file names the graph's diffusion loaders load (their first widget)."""
    files = {str(node["widgets_values"][0]) for node in graph_nodes(graph)
             if node.get("type") in LOADERS and node.get("widgets_values")}
    return sorted(files)


def match(name: str, rules: Iterable[tuple[str, Rule]]) -> Rule | None:
    lower = name.lower()
    return next((rule for key, rule in rules if key in lower), None)


def main_rule(template: str, files: list[str]) -> Rule:
    """The rule of the template's generator: TEMPLATE_RULES, else the first of its files' rules
    that is no estimator (a depth or segmentation model beside a generator), else an estimator,
    else "unclassified"."""
    by_name = match(template, TEMPLATE_RULES)
    if by_name:
        return by_name
    rules = [rule for rule in (match(f, FILE_RULES) for f in files)]
    if None in rules:
        return Rule(f"unknown ({', '.join(files)})", status="unclassified")
    generators = [rule for rule in rules if rule.kind != "estimator"]
    return (generators or rules)[0]


@dataclass
class Row:
    name: str
    category: str
    usage: int
    files: list[str]
    model: str
    kind: str
    status: str


def template_rows(folder: Path, supported: str, not_merged: dict[str, str]) -> tuple[
        list[Row], list[dict]]:
    """A Row for every template with a diffusion loader (a generator's failing status wins over
    another model's "merges" in the same template), and the other templates' name, category
    and usage."""
    rows, others = [], []
    for category in json.loads((folder / "index.json").read_text()):
        for entry in category["templates"]:
            graph = json.loads((folder / f"{entry['name']}.json").read_text())
            files = model_files(graph)
            usage = int(entry.get("usage") or 0)
            if not files:
                others.append({"name": entry["name"], "category": category["title"],
                               "usage": usage})
                continue
            rule = main_rule(entry["name"], files)
            status = status_of(rule, supported, not_merged)
            for other in filter(None, (match(f, FILE_RULES) for f in files)):
                other_status = status_of(other, supported, not_merged)
                if other.kind == "image/video" and status.startswith("merges") and \
                        not other_status.startswith("merges"):
                    rule, status = other, other_status
            rows.append(Row(entry["name"], category["title"], usage, files, rule.family,
                            rule.kind, status))
    return rows, others


def share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def totals(rows: list[Row]) -> dict[str, int]:
    """Usage per status group (merges, refused, runs unmerged, unclassified, other)."""
    out = {"all": 0, "merges": 0, "refused": 0, "runs unmerged": 0, "unclassified": 0,
           "other": 0}
    for row in rows:
        out["all"] += row.usage
        group = next((g for g in ("merges", "refused", "runs unmerged", "unclassified")
                      if row.status.startswith(g)), "other")
        out[group] += row.usage
    return out


def by_model(rows: list[Row], group: str) -> list[tuple[str, int, str]]:
    """Usage per model of one status group, biggest first: (model, usage, status)."""
    usage: dict[tuple[str, str], int] = {}
    for row in rows:
        if row.status.startswith(group):
            usage[row.model, row.status] = usage.get((row.model, row.status), 0) + row.usage
    return sorted(((m, u, s) for (m, s), u in usage.items()), key=lambda x: -x[1])


def report(rows: list[Row], others: list[dict], header: dict) -> str:
    """The Markdown report."""
    video = [row for row in rows if row.kind == "image/video"]
    main, every = totals(video), totals(rows)
    lines = [
        "# ComfyUI's workflow templates: usage on models ToMA merges",
        "",
        f"commit: {header['commit']}",
        f"command: `{header['command']}`",
        f"templates: comfyui-workflow-templates {header['package']} "
        f"(comfyui_workflow_templates_json {header['json_package']}), `templates/index.json` "
        "`usage` counts",
        f"machine: {header['machine']}",
        "",
        "A template runs a local diffusion model where its graph (subgraphs included) has a "
        f"diffusion loader ({', '.join(sorted(LOADERS))}); its model comes from the loaders' "
        "file names (bench/template_usage.py, FILE_RULES and TEMPLATE_RULES). *merges*: the "
        "model's family is in the pack's supported list (nodes/families); the template's own "
        "variant or weights (int8, distilled, LoRAs) were not run here. A template whose "
        "models do not all merge takes the status of the one that does not.",
        "",
        "## Totals",
        "",
        "| templates | count | usage | merges | refused | runs unmerged | unclassified |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, subset, t in (("local image/video diffusion models", video, main),
                             ("all with a diffusion loader (with audio, 3D, upscalers, "
                              "estimators)", rows, every)):
        lines.append(f"| {label} | {len(subset)} | {t['all']} | {t['merges']} "
                     f"({share(t['merges'], t['all'])}) | {t['refused']} "
                     f"({share(t['refused'], t['all'])}) | {t['runs unmerged']} "
                     f"({share(t['runs unmerged'], t['all'])}) | {t['unclassified']} "
                     f"({share(t['unclassified'], t['all'])}) |")
    other_usage = sum(o["usage"] for o in others)
    lines += ["", f"Templates with no diffusion loader (API nodes, LLMs, estimators, basics): "
              f"{len(others)}, usage {other_usage}.", "",
              "## Image/video models that do not merge, by usage", "",
              "| model | usage | share of local image/video usage | status |", "|---|---|---|---|"]
    for group in ("refused", "runs unmerged", "unclassified"):
        lines += [f"| {m} | {u} | {share(u, main['all'])} | {s} |"
                  for m, u, s in by_model(video, group)]
    lines += ["", "## Merging, with a variant the pack's tests do not build", "",
              "| model | usage | share of local image/video usage | status |", "|---|---|---|---|"]
    lines += [f"| {m} | {u} | {share(u, main['all'])} | {s} |"
              for m, u, s in by_model(video, "merges (")]
    lines += ["", "## Every template with a diffusion loader", "",
              "| template | category | usage | model | kind | ToMA |", "|---|---|---|---|---|---|"]
    lines += [f"| `{r.name}` | {r.category} | {r.usage} | {r.model} | {r.kind} | {r.status} |"
              for r in sorted(rows, key=lambda r: (-r.usage, r.name))]
    return "\n".join(lines) + "\n"


def dist_version(site: Path, package: str) -> str:
    """The installed version of a package, from its dist-info folder's name."""
    found = sorted(site.glob(f"{package}-*.dist-info"))
    return found[-1].name[len(package) + 1:-len(".dist-info")] if found else "unknown"


def machine() -> str:
    """The CPU's model name (Linux), else the architecture."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in
             (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    return (names[0] if names else platform.machine()) + " (reads JSON files only: no model runs)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--templates", type=Path,
                        default=SITE / "comfyui_workflow_templates_json" / "templates")
    parser.add_argument("--out", type=Path, help="JSON result (the .md is written beside it)")
    args = parser.parse_args(argv)
    site = args.templates.resolve().parent.parent
    supported, not_merged = pack_lists()
    rows, others = template_rows(args.templates, supported, not_merged)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.strip()
    header = {"commit": commit, "command": COMMAND, "machine": machine(),
              "package": dist_version(site, "comfyui_workflow_templates"),
              "json_package": dist_version(site, "comfyui_workflow_templates_json")}
    text = report(rows, others, header)
    print(text)
    if args.out:
        args.out.write_text(json.dumps({"machine": header["machine"], "config": header,
                                        "supported": supported,
                                        "templates": [asdict(r) for r in rows],
                                        "other_templates": others}, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
