-- 0006: what the runtime needs to survive faults and hostile input (docs/ARCHITECTURE.md
-- "Failure model").

-- Cancellations are committed here before CancelExecution answers (NATS only carries a
-- nudge). The shard's engine applies pending rows on its sweep and deletes them in the
-- same transaction that records the cancellation; a cascade to sub-playbooks inserts the
-- children's rows in the parent's batch transaction.
CREATE TABLE noetl.cancel_request (
  execution_id  bigint PRIMARY KEY,
  shard_id      int         NOT NULL,
  reason        text        NOT NULL,
  requested_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idx_cancel_request_shard ON noetl.cancel_request (shard_id);

-- Engine inputs that failed their batch again and again for a reason that is not an
-- outage (a bug, a malformed message): recorded, skipped, and visible through
-- ExecutionService.ListQuarantined and noetl_engine_quarantined_total; the rest of the
-- shard goes on. stream_seq is the NATS stream position (NULL for a sweep input).
CREATE TABLE noetl.quarantine (
  quarantine_id  bigserial PRIMARY KEY,
  shard_id       int         NOT NULL,
  execution_id   bigint      NOT NULL,
  input_kind     text        NOT NULL,
  stream_seq     bigint,
  attempts       int         NOT NULL,
  error          text        NOT NULL,
  input          bytea,
  created_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idx_quarantine_execution ON noetl.quarantine (execution_id);
CREATE INDEX idx_quarantine_shard ON noetl.quarantine (shard_id, quarantine_id);

-- Sub-playbook nesting depth (0 for a top-level execution), bounded by
-- NOETL_LIMIT_SUBPLAYBOOK_DEPTH, and the reference of a workload too large to travel
-- inside every claim (NOETL_LIMIT_INLINE_WORKLOAD_BYTES).
ALTER TABLE noetl.execution_request ADD COLUMN IF NOT EXISTS depth int NOT NULL DEFAULT 0;
ALTER TABLE noetl.execution_request ADD COLUMN IF NOT EXISTS workload_ref_id bigint;
ALTER TABLE noetl.execution_request ADD COLUMN IF NOT EXISTS payload_bytes int NOT NULL DEFAULT 0;

-- The last statement of a fenced write transaction: fails (SQLSTATE NL001, which aborts
-- the transaction, so its COMMIT rolls back) unless the writer still holds the lease and
-- the lease has not run out on the database's clock at this moment. A member that froze
-- after its fence (SIGSTOP, a VM pause) and wakes past its lease commits nothing.
CREATE FUNCTION noetl.assert_lease(p_role text, p_shard int, p_owner bigint, p_epoch bigint)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
  PERFORM 1 FROM noetl.shard_lease
   WHERE role = p_role AND shard_id = p_shard AND owner_runtime_id = p_owner AND epoch = p_epoch
     AND leased_until > clock_timestamp();
  IF NOT FOUND THEN
    RAISE EXCEPTION 'lease of % shard % epoch % is not held by runtime % any more', p_role, p_shard, p_epoch, p_owner
      USING ERRCODE = 'NL001';
  END IF;
END $$;
