"""The Comfy Registry archive as comfy-cli builds it, and a ComfyUI that has only that archive.

`comfy node pack` (and `comfy node publish`, which uploads the same zip) takes the files git
tracks, less the patterns of .comfyignore, plus pyproject.toml's [tool.comfy] includes (none
here). The archive must hold the product and nothing else: the pack's code, web/ and locales/,
the examples, the licence, the README with the pictures it shows, pyproject.toml and
requirements.txt. It is built here from a copy of the checkout's tracked files (their current
content) in a throwaway git repository, so nothing is written into the checkout; then it is
unpacked into custom_nodes/ of a copy of the ComfyUI under test, whose own main.py must import
it (`--quick-test-for-ci`) and serve its nodes, help pages and translations.

comfy-cli comes from scripts/setup.sh (.cache/tools/).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import urllib.parse
import zipfile
from pathlib import Path

import pytest

import comfy_server
from comfy_server import PACK_FOLDER

ROOT = comfy_server.REPO_ROOT
COMFY_CLI = ROOT / ".cache" / "tools" / "bin" / "comfy"
PRODUCT_FILES = ("__init__.py", "LICENSE", "README.md", "pyproject.toml", "requirements.txt")
PRODUCT_FOLDERS = ("nodes", "toma_core", "web", "locales", "example_workflows")
NEVER = ("bench/", "tests/", "models/", "scripts/", ".github/", ".ci/")
PACK_NODES = ("ToMA", "ToMAAdvanced", "ToMAPreview", "ToMASpeedCheck")
README_PICTURE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
CLI_TIMEOUT_S = 120.0
QUICK_TEST_TIMEOUT_S = 120.0


def tracked_files() -> list[str]:
    """The checkout's files as git lists them (those deleted from the work tree left out)."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True,
                            capture_output=True, text=True).stdout.split("\0")
    return [name for name in listed if name and (ROOT / name).is_file()]


def comfy_cli(folder: Path, home: Path, *arguments: str) -> subprocess.CompletedProcess:
    """comfy-cli in `folder`, with its own settings under `home` (it writes a config file)."""
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}
    return subprocess.run([str(COMFY_CLI), "--skip-prompt", *arguments], cwd=folder, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S, check=False)


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not COMFY_CLI.is_file():
        pytest.skip(f"no comfy-cli at {COMFY_CLI}: run scripts/setup.sh")
    source = tmp_path_factory.mktemp("pack") / PACK_FOLDER
    # .comfyignore counts whether or not it is tracked yet: comfy-cli reads it from the folder.
    for name in {*tracked_files(), ".comfyignore"}:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(["git", "init", "-q"], cwd=source, check=True)
    subprocess.run(["git", "add", "-A"], cwd=source, check=True)
    home = tmp_path_factory.mktemp("home")
    for command in (("node", "validate"), ("node", "pack")):
        result = comfy_cli(source, home, *command)
        assert result.returncode == 0, (command, result.stdout, result.stderr)
    return source / "node.zip"


def archived(archive: Path) -> list[str]:
    with zipfile.ZipFile(archive) as zipped:
        return [name for name in zipped.namelist() if not name.endswith("/")]


def readme_pictures() -> set[str]:
    return {urllib.parse.unquote(name) for name in
            README_PICTURE.findall((ROOT / "README.md").read_text(encoding="utf-8"))}


def test_the_archive_holds_only_the_product(archive: Path) -> None:
    names = archived(archive)
    assert not [name for name in names if name.startswith(NEVER)]
    tops = {name.split("/", 1)[0] for name in names}
    assert tops <= {*PRODUCT_FILES, *PRODUCT_FOLDERS, "docs"}, sorted(tops)
    # docs/ holds the README's pictures (the help pages' own picture is in web/docs/).
    assert {name for name in names if name.startswith("docs/")} == \
        {picture for picture in readme_pictures() if picture.startswith("docs/")}


def test_the_archive_holds_everything_the_nodes_need(archive: Path) -> None:
    names = set(archived(archive))
    needed = {name for name in tracked_files()
              if name in PRODUCT_FILES or name.startswith(tuple(f"{f}/" for f in PRODUCT_FOLDERS))}
    assert needed - names == set()
    assert readme_pictures() - names == set()  # the registry shows the README


def test_comfyui_loads_the_pack_from_the_archive(archive: Path, comfyui_path: Path,
                                                 tmp_path: Path) -> None:
    comfyui = tmp_path / "ComfyUI"
    shutil.copytree(comfyui_path, comfyui, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    with zipfile.ZipFile(archive) as zipped:
        zipped.extractall(comfyui / "custom_nodes" / PACK_FOLDER)

    result = comfy_server.run_quick_test(comfyui, comfyui, QUICK_TEST_TIMEOUT_S)
    log_tail = comfy_server.tail(result.stdout)
    assert result.returncode == 0, log_tail
    assert comfy_server.custom_node_imports(result.stdout).get(PACK_FOLDER) is True, log_tail

    # The quick test only imports the pack: a server shows that its nodes, help pages and
    # translations came along.
    with comfy_server.running_server(comfyui, tmp_path, base=comfyui) as server:
        info = server.get_json("/object_info")
        for name in PACK_NODES:
            assert info[name]["python_module"] == f"custom_nodes.{PACK_FOLDER}", info.get(name)
        status, body = server.get(f"/extensions/{PACK_FOLDER}/docs/ToMA.md")
        assert status == 200 and body == (ROOT / "web" / "docs" / "ToMA.md").read_bytes()
        assert set(PACK_NODES) <= set(server.get_json("/i18n")["zh"]["nodeDefs"])
