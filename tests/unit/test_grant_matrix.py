"""The grant matrix decides every table the migrations create (no database needed; the
integration test checks the same against a migrated database, sequences included)."""

from __future__ import annotations

import re

import pytest

from noetl_common import dbroles
from noetl_common.db import migrations


def test_every_migrated_table_is_in_the_matrix() -> None:
    created = {name for m in migrations()
               for name in re.findall(r"CREATE (?:TABLE|SEQUENCE)\s+(?:IF NOT EXISTS\s+)?noetl\.(\w+)", m.sql)}
    assert created and created - set(dbroles.GRANTS) == set(), "add the table to noetl_common.dbroles.GRANTS"


def test_the_matrix_names_only_known_roles_and_privileges() -> None:
    for grants in dbroles.GRANTS.values():
        assert set(grants) <= set(dbroles.ROLES)
        assert all(set(p) <= {"SELECT", "INSERT", "UPDATE", "DELETE", "USAGE"} for p in grants.values())
    assert all(set(r) <= set(dbroles.ROLES) for r in dbroles.FUNCTIONS.values())


def test_secrets_are_the_apis_alone() -> None:
    for table in ("credential", "api_token", "runtime_secret"):
        assert set(dbroles.GRANTS[table]) == {"api"}
    worker = dbroles.privileges("worker")
    assert set(worker) == {"result_ref", "result_payload", "loop_result", "result_ref_ref_id_seq"}


def test_group_role_names() -> None:
    assert [dbroles.group_role(r) for r in dbroles.ROLES] == [
        "noetl_api", "noetl_shard_manager", "noetl_projector", "noetl_checkpointer", "noetl_compactor",
        "noetl_reaper", "noetl_worker"]
    with pytest.raises(ValueError):
        dbroles.group_role("owner")
