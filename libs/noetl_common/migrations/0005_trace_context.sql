-- 0005: the W3C trace context of an execution (docs/DEPLOY.md "Tracing"). SubmitExecution
-- stores its span's `traceparent` with the request; the engine that owns the shard (after
-- any takeover) continues that trace for every command it issues and every result it
-- folds. NULL when tracing is off (NOETL_OTEL_EXPORTER=none) or the trace was not sampled.

ALTER TABLE noetl.execution_request ADD COLUMN IF NOT EXISTS traceparent text;
