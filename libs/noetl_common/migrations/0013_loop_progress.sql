-- Live progress of loop steps in the read model: the projector counts a loop's accepted
-- iteration results (call.done / call.error events that carry an iteration index) and
-- takes the item count from the loop's step.enter. GetExecution reads them; `run` and
-- `watch` show them while the loop runs. Defaults make existing rows read "not a loop".
ALTER TABLE noetl.execution_step
  ADD COLUMN loop_total  bigint,
  ADD COLUMN loop_done   bigint NOT NULL DEFAULT 0,
  ADD COLUMN loop_failed bigint NOT NULL DEFAULT 0;
