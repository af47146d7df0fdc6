"""README claims that the code and the files decide: widgets and their defaults, the examples
and where they show up, and no invented addresses for a pack that has none yet; and the same of
the pages it leads to (docs/*.md: benchmarks, quality, compatibility, development with the code
map). The README stays short: a reader finds install, placement, settings and expected speed in
it, and the lab's reports in docs/."""

from __future__ import annotations

import json
import re
import urllib.parse
from pathlib import Path

import pytest
import tomllib

import example_gate
from toma_pack.nodes import NODE_SPECS
from toma_pack.nodes.unet_patch import AUTO_MIN_TOKENS, TOKENS_PER_TILE

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))
# The README a new user reads in two minutes (bytes).
README_MAX_BYTES = 15_000
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
# | `name` | default | meaning |   (a row may name two widgets: `start_percent`, `end_percent`)
ROW = re.compile(r"^\| (`\w+`(?:, `\w+`)*) \| ([^|]+) \|", re.MULTILINE)


def section(title: str) -> str:
    start = README.index(f"\n{title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def readme_defaults(node_title: str) -> dict[str, str]:
    text = section(node_title)
    text = text[:text.find("\n### ", 1)] if "\n### " in text[1:] else text
    defaults: dict[str, str] = {}
    for names, values in ROW.findall(text):
        names = re.findall(r"`(\w+)`", names)
        values = values.strip().split(", ") if len(names) > 1 else [values.strip()]
        defaults.update(zip(names, values, strict=True))
    return defaults


def shown(value: object) -> str:
    """How the README writes a default."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) and value >= 100 else str(value)


@pytest.mark.parametrize(("node", "title"), [("ToMA", "### ToMA Token Merge (`ToMA`)"),
                                             ("ToMAAdvanced", "### ToMA Token Merge (Advanced) "
                                                              "(`ToMAAdvanced`)")])
def test_widget_tables_match_the_nodes(node: str, title: str):
    widgets = NODE_SPECS[node].defaults()
    documented = readme_defaults(title)
    if node == "ToMAAdvanced":  # "The four widgets above, then:"
        documented = {**readme_defaults("### ToMA Token Merge (`ToMA`)"), **documented}
    assert list(documented) == list(widgets)
    for name, default in widgets.items():
        readme = documented[name].strip("`").removesuffix(" (auto)")
        assert readme == shown(default), (name, readme, default)


def test_widget_table_quotes_the_unet_constants():
    table = section("## Nodes and widgets")
    assert f"tiles of about {TOKENS_PER_TILE} tokens" in table
    assert f"at least {AUTO_MIN_TOKENS} tokens" in table


def test_the_examples_named_in_the_readme_are_the_example_files():
    where = section("## Where the node goes")
    listed = " ".join(where.split("It holds", 1)[1].split(";")[0].split())
    named = set(re.findall(r"\*([^*]+)\*", listed))
    assert named == {path.stem for path in example_gate.example_files()}
    # An example that needs a later ComfyUI than the pack's floor says which, in the brackets
    # after its name: "*LTX-2 text to video* (... needs ComfyUI v0.8.0 or later ...)".
    for stem in example_gate.MIN_COMFYUI:
        after = re.search(rf"\*{re.escape(stem)}\* \(([^)]*)\)", listed)
        version = example_gate.version_text(example_gate.MIN_COMFYUI[stem])
        assert after and f"needs ComfyUI {version} or later" in after[1], (stem, version)


def test_the_template_category_named_in_the_readme_is_the_pack_s():
    categories = json.loads((ROOT / "locales/en/main.json").read_text())
    category = categories["templateWorkflows"]["category"]
    install = section("## Installation")
    folder = re.search(r"folder named\s+`([^`]+)`", install)[1]
    assert f"*{category[folder]}*" in section("## Where the node goes")


def test_addresses_and_publisher_agree_with_the_installation_text():
    """Publishing is one edit of pyproject.toml away (its header says which): until a repository
    URL and a publisher id are both there, the README says the pack is not in the registry and
    names no address; once they are, it must stop saying so and name the URL it installs from.
    Either way no placeholder ("<...>") may stand in for them."""
    comfy, project = PYPROJECT["tool"]["comfy"], PYPROJECT["project"]
    url = (project.get("urls") or {}).get("Repository")
    publisher = comfy.get("PublisherId")
    for value in (url, publisher, comfy.get("Icon")):
        assert value is None or (value.strip() and "<" not in value), value
    install = section("## Installation")
    if url and publisher:
        assert "not in the Comfy Registry" not in install and url in install
    else:
        assert "not in the Comfy Registry" in install
        assert not re.search(r"https?://", install), install
    icon = comfy.get("Icon")
    assert icon is None or not icon.startswith("http") and (ROOT / icon).is_file(), icon


def links(path: Path) -> set[Path]:
    """The files a Markdown document links (anchors cut, %20 read as a space), resolved from
    its folder."""
    text = path.read_text(encoding="utf-8")
    found = re.findall(r"\]\(((?!https?:|#)[^)\s#]+)(?:#[^)\s]*)?\)", text)
    return {(path.parent / urllib.parse.unquote(target)).resolve() for target in found}


def test_every_file_the_readme_and_its_pages_link_exists():
    # A figure's source must be there to check: an earlier README quoted a deleted result file.
    linked = set().union(*(links(page) for page in (ROOT / "README.md", *DOC_PAGES)))
    assert any(p.is_relative_to(ROOT / "bench" / "results") for p in linked)
    assert {ROOT / "docs" / name for name in ("benchmarks.md", "quality.md", "compatibility.md",
                                             "development.md")} <= links(ROOT / "README.md")
    missing = sorted(str(p) for p in linked if not p.exists())
    assert not missing, missing


def test_the_readme_is_short_and_says_what_a_user_needs_first():
    """Install, placement, settings and expected speed on the README; the lab's reports, with
    their commits and history, on the pages it links."""
    assert len(README.encode()) <= README_MAX_BYTES
    titles = re.findall(r"(?m)^## (.+)$", README)
    assert titles[:5] == ["What it does", "Installation", "Where the node goes",
                          "Nodes and widgets", "Recommended settings"]
    assert "Speed to expect" in README[:README.index("\n## ")]
    assert not re.search(r"\bcommit [0-9a-f]{7}", README)


def test_the_code_map_is_true():
    """Every path the code map (docs/development.md) names exists, and every module of the
    product's two packages (nodes/, toma_core/) is named there, itself or by its folder where
    the map names a folder of like modules (nodes/families/: one a family), so the map cannot
    drift."""
    development = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    code_map = development[development.index("\n## Code map\n"):]
    named = set(re.findall(r"`([\w./-]+)`", code_map))
    paths = {name for name in named if "/" in name or name.endswith(".py")}
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, missing
    modules = {str(p.relative_to(ROOT)) for package in ("nodes", "toma_core")
               for p in (ROOT / package).rglob("*.py") if p.name != "__init__.py"}
    # subpackages named as a folder (not nodes/ or toma_core/ themselves)
    folders = tuple(p for p in paths if p.endswith("/") and p.count("/") > 1)
    unnamed = sorted(m for m in modules - paths if not m.startswith(folders))
    assert not unnamed, unnamed


# Result files from before the suite recorded its commit and command: the README says so where
# it quotes them, and quotes a re-run that has both beside them.
PREDATE_THE_RECORD = {"bench/results/2026-12-01-cpu-quality-sdxl-combined.md",
                      "bench/results/2026-12-01-cpu-quality-flux-combined.md"}


def test_every_result_the_readme_quotes_says_how_it_was_made():
    """Each result file the README links has a JSON beside it that records the machine, the
    commit and the command of its run (but for the ones listed above, which the README marks)."""
    import json

    pages = {page: page.read_text(encoding="utf-8") for page in (ROOT / "README.md", *DOC_PAGES)}
    linked = sorted({str(p.relative_to(ROOT)) for page in pages for p in links(page)
                     if p.is_relative_to(ROOT / "bench" / "results") and p.suffix == ".md"})
    assert linked
    for path in linked:
        result = json.loads((ROOT / path).with_suffix(".json").read_text())
        assert result.get("machine"), path
        if path in PREDATE_THE_RECORD:
            assert any("predate the results' record of their commit" in text
                       for text in pages.values())
            continue
        config = result.get("config", {})
        assert config.get("commit") and config.get("command"), path


def tables(text: str) -> list[list[str]]:
    """Every Markdown table of `text` outside code blocks: its lines, header first."""
    found: list[list[str]] = []
    fenced = False
    previous = ""
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("|"):
            if previous.startswith("|"):
                found[-1].append(line)
            else:
                found.append([line])
        previous = "" if fenced else line
    return found


def cells(line: str) -> int:
    """Cells of a table line (pipes inside backticks do not count)."""
    return len(re.sub(r"`[^`]*`", "``", line).strip().strip("|").split("|"))


DOCUMENTS = ("README.md", "models/README.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "web" / "docs").rglob("*.md")),
    *(str(p.relative_to(ROOT)) for p in DOC_PAGES))


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_table_renders(document: str):
    """A table renders only with its separator line under the header, and shows every cell only
    when each row has the header's count: a sweep's table in the README once lost both,
    printing as one paragraph with half its rows unlabelled."""
    found = tables((ROOT / document).read_text(encoding="utf-8"))
    broken = [t[0][:60] for t in found if len(t) < 2
              or not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", t[1].strip())
              or any(cells(row) != cells(t[0]) for row in t)]
    assert not broken, broken


def test_the_readme_and_its_pages_have_their_tables():
    assert len(tables(README)) >= 5
    assert sum(len(tables(page.read_text(encoding="utf-8"))) for page in DOC_PAGES) > 10


def test_the_compatibility_table_is_the_suites():
    """The README's table of other node packs is tests/compatibility.py's rows, which the
    composition tests run (and whose outcome per ComfyUI version they hold)."""
    from compatibility import table_rows

    assert "\n".join(table_rows()) in section("### With other node packs")
