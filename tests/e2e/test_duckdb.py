"""The duckdb tool end to end, the roles as processes: DuckDB attaches the stack's
Postgres through a stored credential the worker gets from the api for its command (an
alias map in one step, a single `credential:` in another), reads rows a postgres step
wrote, writes back, and its rows reach the next step by reference."""

from __future__ import annotations

import json
import secrets

import pytest
from harness import Runner

from noetl_client import values

pytestmark = pytest.mark.e2e

PLAYBOOK = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: duckdb_e2e, path: tests/duckdb_e2e}
workload: {table: "__TABLE__", factor: 10}
workflow:
  - step: start
    tool:
      kind: postgres
      auth: pg_local
      command: |
        DROP TABLE IF EXISTS public.{{ table }};
        CREATE TABLE public.{{ table }} (id int, region text);
        INSERT INTO public.{{ table }} SELECT g, CASE WHEN g % 2 = 0 THEN 'even' ELSE 'odd' END
          FROM generate_series(1, 9) g;
    next: [{step: crunch}]
  - step: crunch
    tool:
      kind: duckdb
      auth: {pg_db: {credential: pg_local}}
      query: |
        INSTALL postgres; LOAD postgres;
        ATTACH '' AS pg_db (TYPE postgres, SECRET pg_db);
        SELECT region, count(*) AS n, sum(id) * {{ factor }} AS total
          FROM pg_db.public.{{ table }} GROUP BY region ORDER BY region;
    next: [{step: write_back}]
  - step: write_back
    tool:
      kind: duckdb
      credential: pg_local
      commands:
        - "ATTACH '' AS pg (TYPE postgres)"
        - "CREATE TABLE pg.public.{{ table }}_out AS SELECT * FROM (VALUES ('even', {{ crunch.rows[0].n }}),
           ('odd', {{ crunch.rows[1].n }})) t(region, n)"
        - "SELECT sum(n) AS rows_written FROM pg.public.{{ table }}_out"
    next: [{step: end}]
  - step: end
    tool:
      kind: python
      input: {crunched: "{{ crunch }}", written: "{{ write_back.rows[0].rows_written }}"}
      code: "result = {'regions': [r['region'] for r in crunched['rows']], 'written': written}"
"""


def test_duckdb_attaches_postgres_through_stored_credentials(runner: Runner) -> None:
    table = "duck_e2e_" + secrets.token_hex(4)
    out = runner.run(PLAYBOOK.replace("__TABLE__", table), timeout=120)
    assert out.status == "COMPLETED", out.error
    assert out.result("crunch")["rows"] == [{"region": "even", "n": 4, "total": 200},
                                            {"region": "odd", "n": 5, "total": 250}]
    assert out.result("write_back")["rows"] == [{"rows_written": 9}]
    assert out.result("end") == {"regions": ["even", "odd"], "written": 9}
    assert runner.sql(f"SELECT region, n FROM public.{table}_out ORDER BY region") == [("even", 4), ("odd", 5)]
    # by reference: the events carry the reference, never the rows
    done = [e for e in runner.events(out.execution_id) if e.event_type == "call.done" and e.step == "crunch"]
    assert done
    envelope = values.from_struct(done[0].result)
    assert envelope["reference"]["ref_id"] and "rows" not in envelope and "even" not in json.dumps(envelope)
