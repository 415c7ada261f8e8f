"""Synthetic finished executions, written the way the runtime writes them, for retention
tests and the compactor benchmark (``scripts/bench_compactor.py``).

Per execution (on a given day, on snowflake node ``SYNTHETIC_NODE``): ``noetl.result_ref``
rows with ``result_payload`` (tier db; one chain of ``chain`` references for the last
step, a pipeline's tasks), events ``playbook.started``, per step ``step.enter`` +
``call.done`` (a v3 envelope), extra ``call.duplicate`` events to reach the requested
count, ``playbook.completed``; and the read models (``noetl.execution`` COMPLETED,
``noetl.execution_step``). Events carry ``shard_seq`` 0: they count as projected already
and no watermark reader ever sees them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from noetl_common.db import Conn, Pool, ensure_event_partitions, transaction
from noetl_common.ids import shard_for, snowflake_at
from noetl_common.vocab import EventType, ExecutionStatus, ResultStatus, StepViewStatus, command_id

SYNTHETIC_NODE = 1022
PLAYBOOK_PATH = "synthetic/compaction"


@dataclass(frozen=True)
class Synthetic:
    execution_id: int
    shard_id: int
    steps: list[str]
    # the last step's chain, newest first
    chain: list[int]
    events: int


def _envelope(ref_id: int, parent: int | None) -> dict[str, object]:
    return {"status": "ok", "reference": {"ref_id": ref_id, "type": "db", "uri": f"pg://result_payload/{ref_id}"},
            "parent_ref": {"ref_id": parent} if parent else None, "context": {"n": ref_id % 97}}


async def write_executions(pool: Pool, *, day: date, count: int, events_per_execution: int = 10, chain: int = 3,
                           shard_count: int = 16, shard: int | None = None, seq_start: int = 0) -> list[Synthetic]:
    """Write ``count`` finished executions on ``day`` (its partition is created if needed),
    in one transaction (COPY); with ``shard`` only ids of that shard are used.
    ``events_per_execution`` >= 4."""
    if events_per_execution < 4:
        raise ValueError("events_per_execution must be at least 4")
    await ensure_event_partitions(pool, day, 1)
    base = datetime(day.year, day.month, day.day, 12, tzinfo=UTC)
    base_ms = int(base.timestamp() * 1000)
    steps_n = max(1, min((events_per_execution - 2) // 2, 50))
    steps = [f"step_{i}" for i in range(steps_n)]
    refs_per_execution = steps_n - 1 + chain

    ids: list[tuple[int, int]] = []
    seq = seq_start
    while len(ids) < count:
        execution_id = snowflake_at(base_ms + (seq >> 12), SYNTHETIC_NODE, seq & 0xFFF)
        seq += 1
        sid = shard_for(execution_id, shard_count)
        if shard is None or sid == shard:
            ids.append((execution_id, sid))

    made: list[Synthetic] = []
    refs_rows: list[tuple[object, ...]] = []
    payload_rows: list[tuple[object, ...]] = []
    event_rows: list[tuple[object, ...]] = []
    execution_rows: list[tuple[object, ...]] = []
    step_rows: list[tuple[object, ...]] = []
    async with transaction(pool) as conn:
        cur = await conn.execute(
            "SELECT nextval(pg_get_serial_sequence('noetl.result_ref', 'ref_id')) AS ref_id"
            " FROM generate_series(1, %s)", (count * refs_per_execution,))
        pool_ids = iter([int(r["ref_id"]) for r in await cur.fetchall()])
        for n, (execution_id, sid) in enumerate(ids):
            at = base + timedelta(milliseconds=n)
            refs: dict[str, list[int]] = {}
            for i, step in enumerate(steps):
                parent: int | None = None
                chain_ids: list[int] = []
                for t in range(chain if i == steps_n - 1 else 1):
                    ref_id = next(pool_ids)
                    data = json.dumps({"step": step, "task": t, "rows": [1, 2, 3]}).encode()
                    refs_rows.append((ref_id, execution_id, step, command_id(execution_id, step, 1), f"task_{t}", "db",
                                      f"pg://result_payload/{ref_id}", len(data), parent, at))
                    payload_rows.append((ref_id, data))
                    chain_ids.append(ref_id)
                    parent = ref_id
                refs[step] = chain_ids
            rows: list[tuple[object, ...]] = [(execution_id, sid, 0, EventType.PLAYBOOK_STARTED, None, None, None,
                                              json.dumps({"path": PLAYBOOK_PATH}), at)]
            for step in steps:
                chain_ids = refs[step]
                command = command_id(execution_id, step, 1)
                rows.append((execution_id, sid, 0, EventType.STEP_ENTER, step, None, None, json.dumps({"visit": 1}), at))
                rows.append((execution_id, sid, 0, EventType.CALL_DONE, step, command,
                             json.dumps(_envelope(chain_ids[-1], chain_ids[-2] if len(chain_ids) > 1 else None)),
                             json.dumps({"attempt": 1, "worker": "synthetic"}), at))
            while len(rows) < events_per_execution - 1:
                step = steps[len(rows) % steps_n]
                rows.append((execution_id, sid, 0, EventType.CALL_DUPLICATE, step, command_id(execution_id, step, 1),
                             json.dumps(_envelope(refs[step][-1], None)),
                             json.dumps({"attempt": 2, "reason": "synthetic"}), at))
            rows.append((execution_id, sid, 0, EventType.PLAYBOOK_COMPLETED, None, None, json.dumps({"status": ResultStatus.OK}),
                         "{}", at))
            event_rows.extend(rows)
            execution_rows.append((execution_id, sid, PLAYBOOK_PATH, 1, ExecutionStatus.COMPLETED, at, at, at, 0))
            step_rows.extend((execution_id, step, StepViewStatus.COMPLETED, 1, 1, refs[step][-1], at, at) for step in steps)
            made.append(Synthetic(execution_id, sid, steps, list(reversed(refs[steps[-1]])), len(rows)))
        await _copy(conn, "noetl.result_ref (ref_id, execution_id, step, command_id, task, tier, uri, size_bytes,"
                          " parent_ref_id, created_at)", refs_rows)
        await _copy(conn, "noetl.result_payload (ref_id, data)", payload_rows)
        await _copy(conn, "noetl.event (execution_id, shard_id, shard_seq, event_type, step, command_id, result,"
                          " meta, created_at)", event_rows)
        await _copy(conn, "noetl.execution (execution_id, shard_id, playbook_path, playbook_version, status,"
                          " created_at, started_at, ended_at, last_shard_seq)", execution_rows)
        await _copy(conn, "noetl.execution_step (execution_id, step, status, visits, attempts, result_ref_id,"
                          " started_at, ended_at)", step_rows)
    return made


async def _copy(conn: Conn, target: str, rows: list[tuple[object, ...]]) -> None:
    async with conn.cursor().copy(f"COPY {target} FROM STDIN") as copy:
        for row in rows:
            await copy.write_row(row)
