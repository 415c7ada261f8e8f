-- 0003: loops. A collection is rendered once and stored item by item; accepted
-- iteration results are an ordered table of references (never a growing JSON value);
-- loop.done is exactly-once per loop instance.

CREATE TABLE noetl.loop_item (
  execution_id   bigint NOT NULL,
  loop_instance  text   NOT NULL,
  idx            int    NOT NULL,
  item           jsonb,
  PRIMARY KEY (execution_id, loop_instance, idx)
);

CREATE TABLE noetl.loop_result (
  execution_id   bigint NOT NULL,
  loop_instance  text   NOT NULL,
  idx            int    NOT NULL,
  status         text   NOT NULL,
  ref_id         bigint,
  PRIMARY KEY (execution_id, loop_instance, idx)
);

CREATE UNIQUE INDEX uidx_event_loop_done ON noetl.event (execution_id, (meta->>'loop_instance'))
  WHERE event_type = 'loop.done';
