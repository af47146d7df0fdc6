"""The nodes' help pages (web/docs/, which the frontend shows for a node) and translations
(locales/, which ComfyUI serves at /i18n): one page per node and language, every widget
documented with its real default, pictures that exist, and translations that cover every input
and quote the same figures as the English tooltips. That the frontend finds and shows them is
tested in tests/integration/test_frontend.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from toma_pack.nodes import NODE_SPECS
from toma_pack.nodes.raylight_node import TOMA_RAY

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "web" / "docs"
LOCALES = ROOT / "locales"
LANGUAGES = ("en", "zh")
# | `name` | default | meaning |   or, translated,   | `name`（译名） | default | meaning |
ROW = re.compile(r"^\| `(\w+)`(?:（[^）]+）)? \| ([^|]+) \|", re.MULTILINE)
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
NUMBER = re.compile(r"\d+(?:\.\d+)?")
NODE_IDS = list(NODE_SPECS)


def page(node_id: str, language: str) -> str:
    """The help page the frontend fetches: docs/<id>/<locale>.md, else docs/<id>.md (English)."""
    path = DOCS / node_id / f"{language}.md" if language != "en" else DOCS / f"{node_id}.md"
    return path.read_text(encoding="utf-8")


def translations(language: str) -> dict:
    return json.loads((LOCALES / language / "nodeDefs.json").read_text(encoding="utf-8"))


def shown(value: object) -> str:
    """How a page writes a default."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) and value >= 100 else str(value)


def widgets(node_id: str) -> dict:
    return {name: options["default"] for name, (kind, options) in NODE_SPECS[node_id].inputs.items()
            if "default" in options}


@pytest.mark.parametrize("language", LANGUAGES)
@pytest.mark.parametrize("node_id", NODE_IDS)
def test_every_widget_is_documented_with_its_default(node_id: str, language: str) -> None:
    text = page(node_id, language)
    documented = dict(ROW.findall(text))
    assert list(documented) == list(widgets(node_id)), (node_id, language)
    for name, default in widgets(node_id).items():
        written = documented[name].strip().strip("`").split("（")[0].removesuffix(" (auto)")
        assert written.strip() == shown(default), (node_id, language, name, written)


@pytest.mark.parametrize("language", LANGUAGES)
@pytest.mark.parametrize("node_id", NODE_IDS)
def test_page_title_is_the_node_s_name(node_id: str, language: str) -> None:
    name = (NODE_SPECS[node_id].display_name if language == "en"
            else translations(language)[node_id]["display_name"])
    assert page(node_id, language).splitlines()[0] == f"# {name}"


@pytest.mark.parametrize("language", LANGUAGES)
@pytest.mark.parametrize("node_id", NODE_IDS)
def test_pictures_exist_and_no_addresses(node_id: str, language: str) -> None:
    text = page(node_id, language)
    pictures = IMAGE.findall(text)
    assert pictures, "every page shows the preview picture"
    # The frontend resolves a relative picture against /extensions/<pack>/docs/ for every
    # language: the file lies in web/docs/.
    for picture in pictures:
        assert (DOCS / picture).is_file(), picture
    assert not re.search(r"https?://", text), "no invented addresses"


def test_every_file_in_web_is_a_page_or_a_picture_they_show() -> None:
    expected = {DOCS / f"{node_id}.md" for node_id in [*NODE_IDS, TOMA_RAY.node_id]}
    expected |= {DOCS / node_id / f"{language}.md" for node_id in NODE_IDS
                 for language in LANGUAGES if language != "en"}
    expected |= {DOCS / picture for node_id in NODE_IDS for language in LANGUAGES
                 for picture in IMAGE.findall(page(node_id, language))}
    present = {path for path in (ROOT / "web").rglob("*") if path.is_file()}
    assert present == expected


@pytest.mark.parametrize("language", [lang for lang in LANGUAGES if lang != "en"])
def test_translations_cover_every_node_and_input(language: str) -> None:
    defs = translations(language)
    assert list(defs) == NODE_IDS
    for node_id, spec in NODE_SPECS.items():
        node = defs[node_id]
        assert node["display_name"] and node["description"], node_id
        assert list(node["inputs"]) == list(spec.inputs), node_id
        for name, text in node["inputs"].items():
            assert text["name"] and text["tooltip"], (node_id, name)
            english = spec.inputs[name][1]["tooltip"]
            # The figures a tooltip quotes come from the code's constants: a translation that
            # keeps an old figure is caught here.
            assert set(NUMBER.findall(text["tooltip"])) == set(NUMBER.findall(english)), \
                (node_id, name)
        assert set(NUMBER.findall(node["description"])) == set(NUMBER.findall(spec.description))
        assert list(node["outputs"]) == [str(i) for i in range(len(spec.outputs))], node_id


@pytest.mark.parametrize("language", LANGUAGES)
def test_every_language_names_the_template_category(language: str) -> None:
    main = json.loads((LOCALES / language / "main.json").read_text(encoding="utf-8"))
    english = json.loads((LOCALES / "en" / "main.json").read_text(encoding="utf-8"))
    category = main["templateWorkflows"]["category"]
    assert list(category) == list(english["templateWorkflows"]["category"])
    assert all(category.values())


# where a page lists the models the node refuses: "Anything else (...)", "其他模型（...）"
REFUSED = {"en": re.compile(r"Anything else \(([^)]*(?:\([^)]*\)[^)]*)*)\)"),
           "zh": re.compile(r"其他模型（([^）]*)）")}


@pytest.mark.parametrize("language", LANGUAGES)
@pytest.mark.parametrize("node_id", ["ToMA", "ToMAAdvanced"])
def test_no_page_lists_a_supported_model_among_the_refused(node_id: str, language: str) -> None:
    """The models a page says get an error are none of those the node supports (its SUPPORTED
    list, which the node's own error message quotes): a family built after a page was written
    must leave that list."""
    from toma_pack.nodes.apply import SUPPORTED

    found = REFUSED[language].search(page(node_id, language))
    assert found, "the page no longer lists the refused models where this test looks"
    pieces = [p.strip() for p in re.split(r",|、|\bor\b|或", found.group(1)) if p.strip()]
    assert len(pieces) >= 5, pieces
    assert [p for p in pieces if p in SUPPORTED] == []


@pytest.mark.parametrize("language", LANGUAGES)
@pytest.mark.parametrize("node_id", ["ToMA", "ToMAAdvanced"])
def test_the_compatibility_table_is_the_suites(node_id: str, language: str) -> None:
    """The table of other node packs is tests/compatibility.py's rows, which the composition
    tests run: a row that changes there must change here."""
    from compatibility import table_rows

    assert "\n".join(table_rows()) in page(node_id, language)


@pytest.mark.parametrize("page", ["README.md", "web/docs/ToMA.md", "web/docs/ToMAAdvanced.md",
                                  "web/docs/ToMA/zh.md", "web/docs/ToMAAdvanced/zh.md"])
def test_pages_name_every_supported_model(page: str) -> None:
    """The model list lives in the family registry (each family module's MODELS, which the
    node's error joins); the README and the help pages name every model in it."""
    from toma_pack.nodes.families import MODULES, UNET_MODELS

    text = " ".join((ROOT / page).read_text(encoding="utf-8").split())
    names = [re.sub(r" \([^)]*\)", "", name)          # "Qwen-Image (and Edit)": Qwen-Image
             for name in (UNET_MODELS, *(m.MODELS for m in MODULES))]
    models = [piece for name in names for piece in re.split(r", | and ", name)]
    assert [model for model in models if model not in text] == []


def test_the_ray_node_page_names_its_widgets_and_defaults() -> None:
    """The ToMA Token Merge (Ray) node is listed only where raylight is installed (not among
    NODE_SPECS, whose nodes every ComfyUI shows): its English page names each widget with its
    default, in the node's order."""
    text = page(TOMA_RAY.node_id, "en")
    assert text.startswith(f"# {TOMA_RAY.display_name}\n")
    widgets = text[text.index("## Widgets"):]
    written = re.findall(r"`(\w+)` \(`?([^)`]+)`?\)", widgets)
    assert written == [(name, shown(value)) for name, value in TOMA_RAY.defaults().items()]
