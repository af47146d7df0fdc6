"""The few-step and stacked-cache bench's targets and variants (bench/quality/few_steps.py),
on rows written here."""

from __future__ import annotations

from bench.quality import few_steps


def row(variant: str, method: str, speedup: float, psnr: float, part: str = "few",
        steps: int = 4, model: str = "flux-matched") -> dict:
    return {"model": model, "part": part, "steps": steps, "sampler": "euler / sgm_uniform",
            "variant": variant, "method": method, "speedup": speedup, "psnr": psnr}


def test_four_steps_hold_toma_to_its_speed_and_caches_to_theirs_within_2_db():
    rows = [row("unmerged", "unmerged", 1.0, float("inf")),
            row("ToMA defaults", "toma", 1.4, 25.0),
            row("EasyCache 0.2", "EasyCache", 1.5, 24.0),     # within 2 dB, faster than 1.1x
            row("EasyCache 1", "EasyCache", 2.0, 14.0),       # far worse: does not count
            row("MagCache 0.06", "MagCache", 1.05, 30.0),
            {**row("MagCache 0.24", "MagCache", 0, 0), "note": "fails: AttributeError"}]
    del rows[-1]["psnr"], rows[-1]["speedup"]
    found = {t["target"]: (t["value"], t["met"]) for t in few_steps.targets(rows)}
    assert found == {"ToMA defaults >= 1.3x": ("1.40x", True),
                     "EasyCache <= 1.1x within 2 dB of ToMA": ("1.50x", False),
                     "MagCache <= 1.1x within 2 dB of ToMA": ("1.05x", True)}


def test_sdxl_layout_target_is_its_own():
    rows = [row("ToMA defaults", "toma", 1.2, 25.0, model="sdxl-matched")]
    (target,) = few_steps.targets(rows)
    assert target["target"] == "ToMA defaults >= 1.15x" and target["met"] is True


def test_eight_steps_have_no_speed_target():
    assert few_steps.targets([row("ToMA defaults", "toma", 1.0, 25.0, steps=8)]) == []


def test_the_stack_is_held_against_easycache_alone_at_equal_psnr():
    stacked = [row("ToMA defaults", "toma", 1.3, 26.0, "stacked", 20),
               row("EasyCache 0.2", "EasyCache", 1.6, 27.0, "stacked", 20),
               row("EasyCache 0.5", "EasyCache", 2.4, 21.0, "stacked", 20),
               row("ToMA + EasyCache 0.2", "toma+EasyCache", 2.2, 24.0, "stacked", 20),
               row("ToMA + EasyCache 0.5", "toma+EasyCache", 3.0, 20.0, "stacked", 20)]
    found = {t["target"].split(" >=")[0]: (t["value"], t["met"])
             for t in few_steps.targets(stacked)}
    # 0.2 stacked (24 dB) against the fastest EasyCache with >= 24 dB: 0.2 alone (1.6x)
    assert found["ToMA + EasyCache 0.2"] == ("1.38x (EasyCache 0.2)", True)
    # 0.5 stacked (20 dB) against EasyCache 0.5 (21 dB, 2.4x): 1.25x, missed
    assert found["ToMA + EasyCache 0.5"] == ("1.25x (EasyCache 0.5)", False)


def test_caches_per_part_and_the_control_row(monkeypatch):
    monkeypatch.setattr(few_steps, "_peer_node", lambda *a, **k: (lambda m: m))
    few = {v.name: v.method for v in few_steps.variants("flux-matched", "few")}
    assert few["unmerged, again"] == "control"
    assert {m for m in few.values()} == {"unmerged", "control", "toma", "EasyCache",
                                        "First Block Cache", "MagCache"}
    stacked = {v.method for v in few_steps.variants("sdxl-matched", "stacked")}
    # MagCache has no SDXL calibration: SDXL stacks EasyCache only
    assert stacked == {"unmerged", "control", "toma", "EasyCache", "toma+EasyCache"}
