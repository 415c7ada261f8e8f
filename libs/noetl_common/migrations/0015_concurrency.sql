-- Concurrency limits (docs/ARCHITECTURE.md "Concurrency limits"): at most max_running
-- executions of a catalog path run at once, per key (a template over the workload, ''
-- = one queue for the path). The engine takes a slot in its fenced batch when it starts
-- an execution, or records it as waiting; it frees the slot in the batch that ends the
-- execution and nudges the oldest waiter's shard. Slots and waits are per execution, so
-- nothing is counted in memory; order is the execution id's (submission time).
CREATE TABLE noetl.concurrency_limit (
  limit_id      bigserial PRIMARY KEY,
  path          text   NOT NULL,
  key_template  text   NOT NULL DEFAULT '',
  max_running   int    NOT NULL CHECK (max_running > 0),
  created_at    timestamptz NOT NULL DEFAULT now(),
  UNIQUE (path, key_template)
);

CREATE TABLE noetl.concurrency_slot (
  limit_id      bigint NOT NULL,
  key           text   NOT NULL,
  execution_id  bigint NOT NULL,
  acquired_at   timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (limit_id, key, execution_id)
);
CREATE INDEX idx_concurrency_slot_execution ON noetl.concurrency_slot (execution_id);

CREATE TABLE noetl.concurrency_wait (
  limit_id      bigint NOT NULL,
  key           text   NOT NULL,
  execution_id  bigint NOT NULL,
  shard_id      int    NOT NULL,
  since         timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (limit_id, key, execution_id)
);
CREATE INDEX idx_concurrency_wait_execution ON noetl.concurrency_wait (execution_id);
CREATE INDEX idx_concurrency_wait_shard ON noetl.concurrency_wait (shard_id);

-- Take a slot of (limit, key) for an execution, or queue it: one statement, serialised
-- per (limit, key) by a transaction-scoped advisory lock so engines of different shards
-- never both take the last slot. Granted when fewer than max_running hold one and no
-- execution queued before this one waits; a granted waiter leaves the queue. Returns
-- true when the slot is held (also when it was already held: a retried batch).
CREATE FUNCTION noetl.take_slot(p_limit bigint, p_key text, p_max int, p_execution bigint, p_shard int)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
  running int;
  head bigint;
BEGIN
  PERFORM pg_advisory_xact_lock(hashtextextended('noetl.concurrency:' || p_limit || ':' || p_key, 0));
  IF EXISTS (SELECT 1 FROM noetl.concurrency_slot
             WHERE limit_id = p_limit AND key = p_key AND execution_id = p_execution) THEN
    RETURN true;
  END IF;
  SELECT count(*) INTO running FROM noetl.concurrency_slot WHERE limit_id = p_limit AND key = p_key;
  SELECT min(execution_id) INTO head FROM noetl.concurrency_wait WHERE limit_id = p_limit AND key = p_key;
  IF running < p_max AND (head IS NULL OR head >= p_execution) THEN
    DELETE FROM noetl.concurrency_wait WHERE limit_id = p_limit AND key = p_key AND execution_id = p_execution;
    INSERT INTO noetl.concurrency_slot (limit_id, key, execution_id) VALUES (p_limit, p_key, p_execution);
    RETURN true;
  END IF;
  INSERT INTO noetl.concurrency_wait (limit_id, key, execution_id, shard_id)
  VALUES (p_limit, p_key, p_execution, p_shard) ON CONFLICT DO NOTHING;
  RETURN false;
END $$;
