"""Where the upstream conformance data (NoETL's noetl-e2e fixtures) is read from, in place.

``NOETL_CONFORMANCE_DIR`` names the directory holding ``playbooks/`` and
``playbook_test_config.yaml``; the default is ``../shared/conformance/noetl-e2e`` beside
the repository (where CI has it). The data is never copied into the project: a test that
needs it and does not find it is skipped, saying where to put it (a fresh clone without
``../shared`` runs every other test).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ENV = "NOETL_CONFORMANCE_DIR"
REPO = Path(__file__).resolve().parent.parent
DEFAULT = REPO.parent / "shared" / "conformance" / "noetl-e2e"
CONFORMANCE = Path(os.environ.get(ENV) or DEFAULT).resolve()
PLAYBOOKS = CONFORMANCE / "playbooks"
MISSING = (f"upstream conformance data not found at {PLAYBOOKS}: put noetl-e2e's fixtures (playbooks/, "
           f"playbook_test_config.yaml) at {DEFAULT} or set {ENV} to their directory")


def available() -> bool:
    return PLAYBOOKS.is_dir()


def playbook(rel: str) -> Path:
    """The conformance playbook ``rel`` (relative to ``playbooks/``); skips the test when the
    data is not there at all, fails it when the data is there but the file is not."""
    if not available():
        pytest.skip(MISSING)
    path = PLAYBOOKS / rel
    assert path.exists(), f"conformance playbook missing: {path}"
    return path


__all__ = ["CONFORMANCE", "ENV", "MISSING", "PLAYBOOKS", "available", "playbook"]
