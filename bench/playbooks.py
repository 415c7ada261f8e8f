"""The playbooks the scenarios run (the peers run the same shapes: bench/peers/)."""

from __future__ import annotations

HEADER = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata:\n  name: {name}\n  path: bench/{name}\n"

# Three python steps in a row, each passing its value on: a = seed, b = a + 1, c = 2 * b.
# The client checks c == 2 * (seed + 1).
THREE_STEPS = HEADER.format(name="three_steps") + """workload:
  seed: 0
workflow:
  - step: a
    tool: {kind: python, input: {seed: "{{ seed }}"}, code: "result = {'v': seed}"}
    next: {arcs: [{step: b}]}
  - step: b
    tool: {kind: python, input: {v: "{{ a.v }}"}, code: "result = {'v': v + 1}"}
    next: {arcs: [{step: c}]}
  - step: c
    tool: {kind: python, input: {v: "{{ b.v }}"}, code: "result = {'v': v * 2}"}
"""


def three_steps_expected(seed: int) -> int:
    return 2 * (seed + 1)


def fan_out(max_in_flight: int) -> str:
    """A parallel loop over range(n) (``n`` from the payload); iteration i returns 2 * i.
    The sum over n items is n * (n - 1)."""
    return HEADER.format(name=f"fan_out_{max_in_flight}") + f"""workload:
  n: 10
workflow:
  - step: fan
    loop:
      in: "{{{{ n }}}}"
      iterator: i
      spec: {{mode: parallel, max_in_flight: {max_in_flight}}}
    tool: {{kind: python, input: {{i: "{{{{ i }}}}"}}, code: "result = i * 2"}}
"""


def sequential_loop() -> str:
    """The fan-out loop with ``mode: sequential`` (one iteration at a time); the same
    results (iteration i returns 2 * i)."""
    return HEADER.format(name="sequential_loop") + """workload:
  n: 10
workflow:
  - step: fan
    loop:
      in: "{{ n }}"
      iterator: i
      spec: {mode: sequential}
    tool: {kind: python, input: {i: "{{ i }}"}, code: "result = i * 2"}
"""


def fan_out_expected_sum(n: int) -> int:
    return n * (n - 1)


def cursor_drain(table: str, sink: str, credential: str, max_in_flight: int) -> str:
    """A cursor loop: ``max_in_flight`` slots claim pending rows of ``table`` with FOR UPDATE
    SKIP LOCKED; each row runs a postgres task that inserts its id into ``sink`` (a second
    run of a row would bump ``hits``)."""
    claim = (f"UPDATE {table} SET status = 'claimed' WHERE id = (SELECT id FROM {table} "
             f"WHERE status = 'pending' ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING id, v")
    command = (f"INSERT INTO {sink} (id, v) VALUES ({{{{ row.id }}}}, {{{{ row.v }}}}) "
               f"ON CONFLICT (id) DO UPDATE SET hits = {sink}.hits + 1")
    return HEADER.format(name="cursor_drain") + f"""workflow:
  - step: drain
    loop:
      cursor:
        kind: postgres
        auth: {credential}
        claim: "{claim}"
      iterator: row
      spec: {{mode: cursor, max_in_flight: {max_in_flight}}}
    tool:
      - name: save
        kind: postgres
        auth: {credential}
        command: "{command}"
"""
