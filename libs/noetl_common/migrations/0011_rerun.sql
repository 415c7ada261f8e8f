-- 0011: rerun from the failed step (docs/ARCHITECTURE.md "Rerun").
--
-- A rerun is a new execution request linked to the execution it reruns: `rerun_of` (the
-- original's id) and `rerun_from` (the step the caller named; NULL: from where the original
-- failed). RerunExecution commits the row before it answers (idempotency key
-- `rerun/<original>/<key>`); the engine that starts it seeds its state from the original's
-- engine state, loop tables and result references, which nothing deletes (retention only
-- deletes events). The read model shows the link (noetl.execution.rerun_of).
--
-- Privileges: none new (columns of tables the roles already use).
ALTER TABLE noetl.execution_request ADD COLUMN rerun_of bigint;
ALTER TABLE noetl.execution_request ADD COLUMN rerun_from text;
CREATE INDEX idx_execution_request_rerun_of ON noetl.execution_request (rerun_of) WHERE rerun_of IS NOT NULL;
ALTER TABLE noetl.execution ADD COLUMN rerun_of bigint;
