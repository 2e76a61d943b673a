"""The Docker images (deploy/docker) carry every package the distribution installs.

Each Dockerfile copies the package sources one folder at a time and `.dockerignore` lets
only named folders into the build context, so a new package left out of either would build
an image whose `pip install /src` silently lacks it. No image is built here: the lists are
read and compared with pyproject.toml's package list.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((REPO_ROOT / "deploy" / "docker").glob("*.Dockerfile"))


def _installed_packages() -> set[str]:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    return {pattern.rstrip("*") for pattern in patterns}


def test_there_are_images_to_check() -> None:
    assert len(DOCKERFILES) == 3
    assert {"gateway", "backend_engine", "model_files"} <= _installed_packages()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_every_image_copies_every_package(dockerfile: Path) -> None:
    copied = set(re.findall(r"^COPY (\w+) \1$", dockerfile.read_text(), re.MULTILINE))
    assert _installed_packages() <= copied


def test_the_build_context_lets_every_package_in() -> None:
    allowed = set(re.findall(r"^!(\w+)/$", (REPO_ROOT / ".dockerignore").read_text(), re.M))
    assert _installed_packages() <= allowed
