"""Deployment checks (Dockerfile, Helm chart, dashboards, alerts), run by `make check-deploy`.

They need tools `make test` does not install (helm, kubernetes-validate, hadolint, the CRD
validators, prometheus/promtool: scripts/deploy_tools.sh puts them in .tools/ or installs
them), so they are collected only when NOETL_CHECK_DEPLOY=1, which `make check-deploy` sets.
A missing tool is then a failure, never a skip. test_images.py (the built images, run for
real) is collected only when NOETL_CHECK_IMAGES=1 (`make check-images`, which builds them
first) or NOETL_CHECK_DEPLOY=1 (where it skips, saying how to run it).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from deploytools import REPO, VALUES, render, run

# What the Dockerfile copies into the builder stage, besides pyproject.toml.
DOCKER_COPY_DIRS = ("libs", "clients/python", "services", "deploy/docker")

_deploy = os.environ.get("NOETL_CHECK_DEPLOY", "") not in ("", "0")
_images = os.environ.get("NOETL_CHECK_IMAGES", "") not in ("", "0")
if not _deploy and not _images:
    collect_ignore_glob = ["test_*.py"]
elif not _deploy:
    collect_ignore_glob = [p.name for p in Path(__file__).parent.glob("test_*.py") if p.name != "test_images.py"]


@pytest.fixture(scope="session")
def rendered() -> dict[str, str]:
    """helm template output for each values set (see deploytools.VALUES)."""
    return {name: render(name) for name in VALUES}


@pytest.fixture(scope="session")
def image_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The venv the Dockerfile's builder stage makes (/opt/noetl), built here by the same
    script (deploy/docker/build-venv.sh) from a copy of the files the Dockerfile COPYs."""
    base = tmp_path_factory.mktemp("image")
    context = base / "context"
    context.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".mypy_cache", ".ruff_cache", ".pytest_cache",
                                    "*.egg-info", "*.whl")
    shutil.copy(REPO / "pyproject.toml", context / "pyproject.toml")
    for sub in DOCKER_COPY_DIRS:
        shutil.copytree(REPO / sub, context / sub, ignore=ignore)
    venv = base / "opt-noetl"
    run(["sh", str(context / "deploy" / "docker" / "build-venv.sh"), str(context), str(venv), str(base / "wheels")],
        env={**os.environ, "PYTHON": sys.executable}, timeout=900)
    return venv
