-- 0002: epoch barriers. The engine records the last checkpoint barrier it appended on
-- its lease row; `checkpoint.committed` is exactly-once per (shard, checkpoint epoch):
-- its execution_id is derived from (epoch, shard) on the reserved snowflake node 1023.

ALTER TABLE noetl.shard_lease
  ADD COLUMN barrier_epoch bigint NOT NULL DEFAULT 0,
  ADD COLUMN barrier_seq   bigint NOT NULL DEFAULT 0;

CREATE UNIQUE INDEX uidx_event_checkpoint_committed ON noetl.event (execution_id, event_type)
  WHERE event_type = 'checkpoint.committed';

CREATE INDEX idx_checkpoint_latest ON noetl.checkpoint (shard_id, epoch DESC);
