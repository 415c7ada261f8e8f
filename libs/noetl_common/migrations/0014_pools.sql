-- Worker pools and priorities (docs/ARCHITECTURE.md "Worker pools and priorities").
-- A command's placement: the pool whose workers may take it, the labels a worker must
-- have (NULL: none) and its priority. The engine sets them when it inserts a command; the
-- claim checks the claiming worker qualifies; the reaper republishes on the pool's and
-- priority's subject and counts queued commands no live worker could take. Defaults make
-- existing rows (and a runtime that does not set them) read "default pool, normal".
ALTER TABLE noetl.command
  ADD COLUMN pool     text NOT NULL DEFAULT 'default',
  ADD COLUMN requires jsonb,
  ADD COLUMN priority text NOT NULL DEFAULT 'normal',
  ADD CONSTRAINT chk_command_priority CHECK (priority IN ('high', 'normal', 'low'));

-- The submission's priority (SubmitExecutionRequest.priority); NULL: the playbook's.
ALTER TABLE noetl.execution_request
  ADD COLUMN priority text,
  ADD CONSTRAINT chk_request_priority CHECK (priority IN ('high', 'normal', 'low'));

-- What a worker declared when it joined (JoinRequest): the pools it serves, its labels and
-- the tool kinds it runs (NULL: every kind). Other roles leave them NULL.
ALTER TABLE noetl.runtime
  ADD COLUMN pools  text[],
  ADD COLUMN labels jsonb,
  ADD COLUMN tools  text[];
