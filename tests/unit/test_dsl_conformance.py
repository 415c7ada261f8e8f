"""Every upstream conformance playbook parses unchanged; the broken one is rejected."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conformance_data import MISSING, PLAYBOOKS, available, playbook

from noetl_common.errors import PlaybookInvalid
from noetl_dsl import TOOL_KINDS, Playbook, parse_playbook

BROKEN = PLAYBOOKS / "broken_playbooks/should_error_tool_is_required.yaml"
VALID = sorted(p for p in PLAYBOOKS.rglob("*.yaml") if p != BROKEN)


def _id(path: Path) -> str:
    return str(path.relative_to(PLAYBOOKS))


def test_conformance_playbooks_are_present() -> None:
    if not available():
        pytest.skip(MISSING)
    assert BROKEN.is_file(), f"conformance data incomplete under {PLAYBOOKS}"
    assert len(VALID) >= 26


@pytest.mark.parametrize("path", VALID, ids=_id)
def test_conformance_playbook_parses(path: Path) -> None:
    pb = parse_playbook(path.read_text())
    assert isinstance(pb, Playbook)
    assert pb.apiVersion.startswith("noetl.io/")
    assert pb.path
    assert pb.start_step in pb.step_names
    for step in pb.workflow:
        assert step.tasks, step.step
        assert all(t.kind in TOOL_KINDS for t in step.tasks)
        assert all(pb.has_step(a.step) for a in step.arcs)


def test_broken_playbook_is_rejected_with_every_problem() -> None:
    with pytest.raises(PlaybookInvalid, match=r"(tool.*required|no sql command provided)") as info:
        parse_playbook(playbook(str(BROKEN.relative_to(PLAYBOOKS))).read_text())
    exc = info.value
    # The postgres task has no command (it sits on the step); step 'end', with neither tool
    # nor loop, is a noop as upstream runs it.
    assert exc.path == "workflow[1].tool.command"
    problems = exc.message.split("; ")
    assert len(problems) == 1
    assert problems[0].startswith(
        "workflow[1].tool.command: postgres tool requires 'command' or 'query': no sql command provided")
    assert "found 'command' on the step itself" in problems[0]
    assert re.search(r"(tool.*required|no sql command provided)", str(exc))
