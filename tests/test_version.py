"""One version: `adaserve.__version__` is the source; pyproject reads it, CHANGELOG's
newest release heading names it, `adaserve --version` prints it, and the container
images the manifests run are tagged with it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

import adaserve
from adaserve.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_reads_the_version_from_the_package() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert "version" not in project and "version" in project["dynamic"]
    dynamic = pyproject["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "adaserve.__version__"}
    # The SPDX string form: a TOML table is deprecated (three warnings per install).
    assert project["license"] == "Apache-2.0"


def test_changelog_newest_release_is_the_version() -> None:
    releases = re.findall(r"^## (\d+\.\d+\.\d+)\b", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases, "CHANGELOG.md has no release heading"
    assert releases[0] == adaserve.__version__


def test_cli_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == adaserve.__version__


def test_image_tags_are_the_version() -> None:
    files = [*ROOT.glob("docker/Dockerfile*"), *ROOT.glob("k8s/**/*.yaml"), ROOT / "k8s/README.md"]
    tags = set()
    for path in files:
        text = path.read_text()
        tags |= set(re.findall(r"adaserve:(\d+\.\d+\.\d+)-(?:cpu|cuda)", text))
        tags |= set(re.findall(r"newTag: (\d+\.\d+\.\d+)-", text))
        tags |= set(re.findall(r"app\.kubernetes\.io/version: (\S+)", text))
    assert tags == {adaserve.__version__}
