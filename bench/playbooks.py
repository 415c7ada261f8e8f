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


PFT_TABLES = ("facility", "queue", "page_rows", "demographics", "mds")


def pft_table(prefix: str, name: str) -> str:
    return f"public.{prefix}_{name}"


def pft_flow(prefix: str, credential: str) -> str:
    """The PFT shape (the bench's ``pft`` scenario; the same shape as the e2e test's
    tests/e2e/playbooks/pft_flow.yaml, on tables ``public.<prefix>_*`` the scenario creates):
    seed the facilities and an execution-scoped queue of patient batches, one per data type
    (``batch_size`` patients each); ``len(batch_slots)`` parallel slots each loop claim
    (FOR UPDATE SKIP LOCKED) -> http fetch of the batch (a 503 retried) -> save (the rows and
    the batch marked done in one statement) by jumping back to the claim until it comes back
    empty; then a facility loop pages through each facility's MDS endpoint; a validate step
    counts what landed and a python step checks it. The sizes come from the payload."""
    yaml = HEADER.format(name="pft_flow") + """workload:
  api_url: http://127.0.0.1:1
  num_facilities: 2
  patients_per_facility: 10
  batch_size: 10
  concurrency: 4
  batch_slots: [1, 2, 3, 4]
  mds_page_size: 4
workflow:
  - step: start
    tool:
      kind: postgres
      auth: __AUTH__
      command: |
        INSERT INTO __P___facility (facility_id)
        SELECT g FROM generate_series(1, {{ workload.num_facilities | int }}) g;
        SELECT count(*) AS facilities FROM __P___facility;
    set:
      ctx.facility_count: "{{ output.data.rows[0].facilities }}"
    next: {arcs: [{step: seed_batches}]}

  - step: seed_batches
    tool:
      kind: postgres
      auth: __AUTH__
      command: |
        WITH patient AS (
          SELECT (f.facility_id - 1) * {{ workload.patients_per_facility | int }} + s AS patient_id
          FROM __P___facility f, generate_series(1, {{ workload.patients_per_facility | int }}) s
        ), batched AS (
          SELECT patient_id, (patient_id - 1) / {{ workload.batch_size | int }} + 1 AS batch_id FROM patient
        )
        INSERT INTO __P___queue (execution_id, data_type, batch_id, patient_ids)
        SELECT '{{ execution_id }}', t.data_type, b.batch_id, array_agg(b.patient_id ORDER BY b.patient_id)
        FROM batched b, unnest(ARRAY['assessments', 'conditions', 'medications', 'vital_signs',
                                     'demographics']) AS t(data_type)
        GROUP BY t.data_type, b.batch_id;
        SELECT count(*) AS batches FROM __P___queue WHERE execution_id = '{{ execution_id }}';
    set:
      ctx.batches: "{{ output.data.rows[0].batches }}"
    next:
      arcs:
        - step: process_batches
          when: "{{ output.status == 'ok' and (output.data.rows[0].batches | int) > 0 }}"

  - step: process_batches
    loop:
      in: "{{ workload.batch_slots }}"
      iterator: slot
      spec: {mode: parallel, max_in_flight: "{{ workload.concurrency | int }}"}
    tool:
      - name: claim_batch
        kind: postgres
        auth: __AUTH__
        command: |
          UPDATE __P___queue q
          SET status = 'claimed', worker = 'slot-{{ slot }}', attempts = q.attempts + 1
          FROM (SELECT data_type, batch_id FROM __P___queue
                WHERE execution_id = '{{ execution_id }}' AND status = 'pending'
                ORDER BY batch_id, data_type FOR UPDATE SKIP LOCKED LIMIT 1) c
          WHERE q.execution_id = '{{ execution_id }}' AND q.data_type = c.data_type AND q.batch_id = c.batch_id
          RETURNING q.data_type, q.batch_id, array_to_string(q.patient_ids, ',') AS ids;
        set:
          claimed: "{{ output.rows[0] if output.row_count else none }}"
        spec:
          policy:
            rules:
              - when: "{{ (output.data.row_count | default(0) | int) == 0 }}"
                then: {do: break}
              - else:
                  then:
                    do: continue
                    set:
                      iter.data_type: "{{ output.data.rows[0].data_type }}"
                      iter.ids: "{{ output.data.rows[0].ids }}"
      - name: fetch_batch
        kind: http
        method: GET
        url: "{{ api_url }}/api/v1/pft/batch/{{ iter.data_type }}"
        params:
          patientIds: "{{ iter.ids }}"
          patientsPerFacility: "{{ workload.patients_per_facility }}"
        spec:
          policy:
            rules:
              - when: "{{ output.status == 'error' and output.error.retryable }}"
                then: {do: retry, attempts: 3, backoff: none}
              - when: "{{ output.status == 'error' }}"
                then: {do: fail}
              - else:
                  then:
                    do: continue
                    set:
                      iter.rows: "{{ output.data.data.rows }}"
                      iter.row_count: "{{ output.data.data.rowCount }}"
      - name: save_batch
        kind: postgres
        auth: __AUTH__
        command: |
          WITH src AS (
            SELECT * FROM jsonb_to_recordset('{{ iter.rows | tojson | replace("'", "''") }}'::jsonb)
              AS r(patient_id INTEGER, facility_mapping_id INTEGER, page_number INTEGER, payload JSONB,
                   is_last_page BOOLEAN)
          ), saved AS (
          {% if iter.data_type == 'demographics' %}
            INSERT INTO __P___demographics (patient_id, facility_id, payload)
            SELECT patient_id, facility_mapping_id, payload FROM src
            ON CONFLICT (patient_id) DO UPDATE SET payload = EXCLUDED.payload
          {% else %}
            INSERT INTO __P___page_rows (data_type, patient_id, facility_id, page_number, payload, is_last_page)
            SELECT '{{ iter.data_type }}', patient_id, facility_mapping_id, page_number, payload, is_last_page
            FROM src
            ON CONFLICT (data_type, patient_id, page_number) DO UPDATE SET payload = EXCLUDED.payload
          {% endif %}
            RETURNING 1
          ), done AS (
            UPDATE __P___queue SET status = 'done'
            WHERE execution_id = '{{ execution_id }}' AND data_type = '{{ claimed.data_type }}'
              AND batch_id = {{ claimed.batch_id | int }}
            RETURNING 1
          )
          SELECT (SELECT count(*) FROM saved) AS saved, (SELECT count(*) FROM done) AS done;
        spec:
          policy:
            rules:
              - when: "{{ output.status == 'ok' and output.data.rows[0].saved == iter.row_count }}"
                then: {do: jump, to: claim_batch}
              - else:
                  then: {do: fail}
    next:
      arcs:
        - step: next_facility
          when: "{{ event.name == 'loop.done' and output.data.stats.failed == 0 }}"

  - step: next_facility
    tool:
      kind: postgres
      auth: __AUTH__
      query: SELECT facility_id FROM __P___facility WHERE active ORDER BY facility_id LIMIT 1;
    set:
      ctx.facility_id: "{{ output.data.rows[0].facility_id if (output.data.row_count | int) > 0 else 0 }}"
    next:
      arcs:
        - step: fetch_mds
          when: "{{ (output.data.row_count | int) > 0 }}"
        - step: validate
          when: "{{ (output.data.row_count | int) == 0 }}"

  - step: fetch_mds
    tool:
      - name: fetch_page
        kind: http
        method: GET
        url: "{{ api_url }}/api/v1/pft/mds"
        params:
          facility: "{{ ctx.facility_id }}"
          page: "{{ iter.page | default(1) }}"
          pageSize: "{{ workload.mds_page_size }}"
        set:
          items: "{{ output.data['items'] }}"
        spec:
          policy:
            rules:
              - when: "{{ output.status == 'error' and output.error.retryable }}"
                then: {do: retry, attempts: 3, backoff: none}
              - else:
                  then:
                    do: continue
                    set:
                      iter.has_more: "{{ output.data.data.hasMore }}"
                      iter.page: "{{ output.data.data.page + 1 }}"
      - name: save_page
        kind: postgres
        auth: __AUTH__
        command: |
          INSERT INTO __P___mds (assessment_id, facility_id)
          SELECT assessment_id, facility_mapping_id
          FROM jsonb_to_recordset('{{ items | tojson }}'::jsonb) AS r(assessment_id TEXT, facility_mapping_id INTEGER)
          ON CONFLICT DO NOTHING;
        spec:
          policy:
            rules:
              - when: "{{ iter.has_more }}"
                then: {do: jump, to: fetch_page}
              - else:
                  then: {do: break}
    next: {arcs: [{step: mark_facility}]}

  - step: mark_facility
    tool:
      kind: postgres
      auth: __AUTH__
      command: |
        WITH marked AS (
          UPDATE __P___facility SET active = FALSE WHERE facility_id = {{ ctx.facility_id | int }} RETURNING 1
        )
        SELECT (SELECT count(*) FROM __P___facility WHERE active) - (SELECT count(*) FROM marked) AS remaining;
    set:
      ctx.remaining: "{{ output.data.rows[0].remaining }}"
    next:
      arcs:
        - step: next_facility
          when: "{{ (output.data.rows[0].remaining | int) > 0 }}"
        - step: validate
          when: "{{ (output.data.rows[0].remaining | int) == 0 }}"

  - step: validate
    tool:
      kind: postgres
      auth: __AUTH__
      query: |
        SELECT f.facility_id,
          (SELECT count(*) FROM __P___page_rows p
           WHERE p.facility_id = f.facility_id AND p.is_last_page) AS last_pages,
          (SELECT count(*) FROM __P___demographics d WHERE d.facility_id = f.facility_id) AS demographics,
          (SELECT count(*) FROM __P___mds m WHERE m.facility_id = f.facility_id) AS mds
        FROM __P___facility f ORDER BY f.facility_id;
    set:
      ctx.validation: "{{ output.data.rows }}"
    next: {arcs: [{step: check_results}]}

  - step: check_results
    tool:
      kind: python
      input:
        rows: "{{ ctx.validation }}"
        per_facility: "{{ workload.patients_per_facility }}"
        facilities: "{{ workload.num_facilities }}"
      code: |
        n = int(per_facility)
        # each patient: one last page of each of the 4 paged types, one demographics row
        short = [r for r in rows if r["last_pages"] != 4 * n or r["demographics"] != n or r["mds"] == 0]
        result = {"status": "passed" if len(rows) == int(facilities) and not short else "failed",
                  "facilities_checked": len(rows), "short": short}
    set:
      ctx.check_status: "{{ output.data.status }}"
    next: {arcs: [{step: end}]}

  - step: end
    tool:
      kind: python
      input: {check_status: "{{ ctx.check_status }}", batches: "{{ ctx.batches }}", remaining: "{{ ctx.remaining }}"}
      code: |
        result = {"status": "completed" if check_status == "passed" else "failed", "check_status": check_status,
                  "batches": batches, "remaining": remaining}
"""
    return yaml.replace("__P__", f"public.{prefix}").replace("__AUTH__", credential)
