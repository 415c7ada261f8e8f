-- 0012: dead letters (docs/ARCHITECTURE.md "Dead letters (as built)").
--
-- A dead letter is a command that exhausted its attempts: its accepted result was a
-- call.error (a task that still failed after its policy's retries), or its claim expired
-- past NOETL_COMMAND_MAX_ATTEMPTS (command.dead_lettered). The shard's engine inserts the
-- row in the fenced batch that accepts that failure, and marks it redriven in the batch
-- that re-issues it. Nothing else writes it.
CREATE TABLE noetl.dead_letter (
  dead_letter_id     bigserial PRIMARY KEY,
  execution_id       bigint      NOT NULL,
  shard_id           int         NOT NULL,
  command_id         text        NOT NULL UNIQUE,
  step               text        NOT NULL,
  loop_instance      text,                   -- a loop iteration's: its loop instance and index
  loop_index         int,
  attempts           int         NOT NULL,   -- claims of the command (a task's policy retries run inside one)
  reason             text        NOT NULL,   -- 'failed' (call.error) | 'expired' (claim leases ran out)
  error              jsonb       NOT NULL,   -- the error of the accepted result (ErrorInfo's fields)
  worker_id          text,                   -- the worker that last held the command
  status             text        NOT NULL DEFAULT 'dead',
  redrive_command_id text,                   -- the command the redrive issued
  redriven_at        timestamptz,
  redriven_by        text,
  refusal            text,                   -- why the engine refused the last redrive request
  created_at         timestamptz NOT NULL DEFAULT now(),
  CONSTRAINT chk_dead_letter_status CHECK (status IN ('dead', 'redriven')),
  CONSTRAINT chk_dead_letter_reason CHECK (reason IN ('failed', 'expired'))
);
CREATE INDEX idx_dead_letter_execution ON noetl.dead_letter (execution_id);
CREATE INDEX idx_dead_letter_status ON noetl.dead_letter (status, dead_letter_id);

-- A redrive is committed here before RedriveDeadLetter answers (NATS only carries a nudge,
-- like noetl.cancel_request). The shard's engine applies pending rows (nudge or sweep) and
-- deletes them in the batch that re-issues the command, or that records its refusal.
CREATE TABLE noetl.redrive_request (
  dead_letter_id  bigint      PRIMARY KEY REFERENCES noetl.dead_letter (dead_letter_id),
  execution_id    bigint      NOT NULL,
  shard_id        int         NOT NULL,
  requested_by    text        NOT NULL DEFAULT '',
  requested_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idx_redrive_request_shard ON noetl.redrive_request (shard_id, requested_at);

-- A redriven execution that had failed may end again: its terminal event and a redriven
-- loop's second loop.done carry meta.redrive (how many redrives the execution had), so
-- the exactly-once indexes are per redrive generation (no meta.redrive: generation 0).
DROP INDEX noetl.uidx_event_terminal;
CREATE UNIQUE INDEX uidx_event_terminal ON noetl.event (execution_id, event_type, (COALESCE(meta->>'redrive', '0')))
  WHERE event_type IN ('playbook.completed', 'playbook.failed', 'playbook.cancelled');
DROP INDEX noetl.uidx_event_loop_done;
CREATE UNIQUE INDEX uidx_event_loop_done ON noetl.event (execution_id, (meta->>'loop_instance'),
  (COALESCE(meta->>'redrive', '0'))) WHERE event_type = 'loop.done';
