"""The vocabulary (noetl_common.vocab): each spelling pinned (stored in Postgres and in
JetStream's duplicate window: a rename is a migration), the proto enums it maps to, and a
scan of the source: no status or event type is written out anywhere else."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from noetl_common import vocab
from noetl_common.vocab import (
    CommandStatus,
    EngineStatus,
    EventType,
    ExecutionStatus,
    StepViewStatus,
)
from noetl_proto.v1 import common_pb2

ROOT = Path(__file__).resolve().parents[2]
VOCAB = ROOT / "libs/noetl_common/vocab.py"
MIGRATIONS = ROOT / "libs/noetl_common/migrations"


def test_the_spellings_are_pinned() -> None:
    assert [e.value for e in EventType] == [
        "playbook.started", "playbook.completed", "playbook.failed", "playbook.cancelled", "playbook.rerun",
        "step.enter", "step.kept", "call.done", "call.error", "call.duplicate", "command.reissued",
        "command.dead_lettered", "command.redriven", "loop.next", "loop.done", "loop.failed",
        "checkpoint.committed"]
    assert [s.value for s in CommandStatus] == ["queued", "claimed", "done", "failed", "cancelled", "dead"]
    assert [s.value for s in EngineStatus] == ["running", "completed", "failed", "cancelled"]
    assert EngineStatus.FAILED.public is ExecutionStatus.FAILED
    assert f"status = '{CommandStatus.QUEUED}'" == "status = 'queued'"  # formats as its value in SQL text


def test_command_ids_and_msg_ids_keep_their_formats() -> None:
    assert vocab.command_id(42, "fetch", 3) == "42:fetch:3"
    assert vocab.command_id(42, "fetch", 3, 17) == "42:fetch:3:17"
    assert vocab.execution_of_command("42:fetch:3:17") == 42
    assert vocab.execution_of_command("x:fetch:3") is None
    assert vocab.notice_msg_id("42:a:1", 2) == "42:a:1#2"
    assert vocab.republish_msg_id("42:a:1", 2, 9) == "42:a:1#2#r9"
    assert vocab.result_msg_id("42:a:1", 2) == "42:a:1#2#result"
    assert vocab.expired_msg_id("42:a:1", 2) == "expired#42:a:1#2"
    assert vocab.submit_msg_id(42) == "submit#42"
    assert vocab.cancel_msg_id(42) == "cancel#42"
    assert vocab.redrive_msg_id(7) == "redrive#7"
    assert vocab.barrier_msg_id(3, 99) == "barrier#3#99"


def test_the_statuses_map_onto_the_proto_enums() -> None:
    for s in ExecutionStatus:
        assert common_pb2.ExecutionStatus.Value(s.proto_name) > 0
    assert {n for n in common_pb2.ExecutionStatus.keys() if n != "EXECUTION_STATUS_UNSPECIFIED"} == \
        {s.proto_name for s in ExecutionStatus}
    assert {n for n in common_pb2.StepStatus.keys() if n != "STEP_STATUS_UNSPECIFIED"} == \
        {s.proto_name for s in StepViewStatus}


def test_the_schema_allows_exactly_the_command_statuses() -> None:
    schema = "\n".join(p.read_text() for p in MIGRATIONS.glob("*.sql"))
    allowed = re.search(r"chk_command_status CHECK \(status IN \(([^)]*)\)\)", schema)
    assert allowed is not None
    assert {w.strip(" '") for w in allowed.group(1).split(",")} == {s.value for s in CommandStatus}


# What may not be written out outside vocab.py (in code: docstrings and comments may name
# them): a string constant that IS an event type, an API status or a command status, and
# any status literal compared or stored inside SQL text.
_EXACT = {e.value: "an event type" for e in EventType}
_EXACT |= {s.value: "an API status" for s in (*ExecutionStatus, *StepViewStatus)}
_EXACT |= {"queued": "a command status", "claimed": "a command status"}
_IN_SQL = [
    re.compile(r"""\bstatus\s*(?:=|<>|!=)\s*'[a-z_]+'""", re.IGNORECASE),
    re.compile(r"""\bstatus\s+(?:NOT\s+)?IN\s*\(\s*'""", re.IGNORECASE),
]


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def spelled_out(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str) or id(node) in skip:
            continue
        text = node.value
        if text in _EXACT:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {_EXACT[text]} {text!r}")
        elif any(p.search(text) for p in _IN_SQL):
            found.append(f"{path.relative_to(root)}:{node.lineno}: a status literal in SQL: {text.strip()[:90]}")
    return found


def test_the_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('"""call.done in a docstring is fine"""\nx = "call.done"\n'
                      'y = "SELECT 1 WHERE status = \'queued\'"\nz = f"status = \'{x}\'"\n')
    found = spelled_out(sample, tmp_path)
    assert [f.split(": ", 1)[0] for f in found] == ["sample.py:2", "sample.py:3"], found


def test_no_status_or_event_type_is_spelled_outside_the_vocabulary() -> None:
    found = []
    for base in ("libs", "services"):
        for path in (ROOT / base).rglob("*.py"):
            if "noetl_proto" not in path.parts and path != VOCAB:
                found += spelled_out(path)
    assert not found, "written out (use noetl_common.vocab):\n" + "\n".join(found)


def test_the_nats_subjects_keep_their_formats() -> None:
    # subjects are in every deployed NATS account's permissions (natsperms) and consumers'
    # filters: a rename needs both changed in step
    from noetl_common import natsio

    assert natsio.events_subject(3, natsio.KIND_CALL) == "noetl.events.3.call"
    assert natsio.events_filter(3) == "noetl.events.3.>"
    assert natsio.commands_subject("gpu", "high", 3) == "noetl.commands.gpu.high.3"
    assert natsio.commands_filter("gpu", "high") == "noetl.commands.gpu.high.*"
    assert natsio.progress_subject(42) == "noetl.progress.42"
    assert natsio.projector_subject(3) == "noetl.projector.3"
    assert natsio.checkpointer_subject(3) == "noetl.checkpointer.3"
    assert natsio.cancel_subject(3) == "noetl.cancel.3"
    assert natsio.cancel_filter() == "noetl.cancel.*"
    assert [natsio.KIND_CALL, natsio.KIND_SUBMIT, natsio.KIND_CANCEL, natsio.KIND_REDRIVE, natsio.KIND_EXPIRED,
            natsio.KIND_BARRIER] == ["call", "submit", "cancel", "redrive", "expired", "barrier"]
