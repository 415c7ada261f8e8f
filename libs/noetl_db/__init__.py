"""The data layer: every statement on a table lives in the module that owns it.

    module          tables
    leases          runtime, leader_lease, shard_lease (and the one fence())
    events          event, quarantine
    commands        command
    engine_state    engine_state
    requests        execution_request, cancel_request, redrive_request
    loops           loop_item, loop_result
    dead_letters    dead_letter
    read_models     execution, execution_step, projection_checkpoint
    checkpoints     checkpoint, manifest, manifest_part
    limits          concurrency_limit, concurrency_slot, concurrency_wait
    catalog         catalog
    credentials     credential
    schedules       schedule, schedule_tick
    tokens          api_token, runtime_secret

Results (``result_ref``, ``result_payload``) stay with the result store (``noetl_store``),
the schema's own ``schema_migration`` with the migration runner (``noetl_common.db``).
A statement that spans tables (a join, a CTE reading another table) lives with the table
it writes, or with the table it is about when it only reads. ``OWNERS`` says the same as
data; tests/unit/test_data_layer.py holds the source to it. Functions take an open
connection (``Conn``): the caller owns the transaction, its fence and its pipeline. The
engine's batch writes also come as ``Write`` statements (``*_write``), which
``leases.fenced_batch`` composes into one fenced statement.
"""

from __future__ import annotations

from ._conn import Write, gated

__all__ = ["OWNERS", "Write", "gated"]

OWNERS: dict[str, str] = {
    "runtime": "noetl_db.leases", "leader_lease": "noetl_db.leases", "shard_lease": "noetl_db.leases",
    "event": "noetl_db.events", "quarantine": "noetl_db.events",
    "command": "noetl_db.commands",
    "engine_state": "noetl_db.engine_state",
    "execution_request": "noetl_db.requests", "cancel_request": "noetl_db.requests",
    "redrive_request": "noetl_db.requests",
    "loop_item": "noetl_db.loops", "loop_result": "noetl_db.loops",
    "dead_letter": "noetl_db.dead_letters",
    "execution": "noetl_db.read_models", "execution_step": "noetl_db.read_models",
    "projection_checkpoint": "noetl_db.read_models",
    "checkpoint": "noetl_db.checkpoints", "manifest": "noetl_db.checkpoints", "manifest_part": "noetl_db.checkpoints",
    "concurrency_limit": "noetl_db.limits", "concurrency_slot": "noetl_db.limits",
    "concurrency_wait": "noetl_db.limits",
    "catalog": "noetl_db.catalog",
    "credential": "noetl_db.credentials",
    "schedule": "noetl_db.schedules", "schedule_tick": "noetl_db.schedules",
    "api_token": "noetl_db.tokens", "runtime_secret": "noetl_db.tokens",
    "result_ref": "noetl_store._postgres", "result_payload": "noetl_store._postgres",
    "schema_migration": "noetl_common.db",
}
