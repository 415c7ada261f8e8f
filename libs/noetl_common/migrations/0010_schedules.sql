-- 0010: schedules (docs/ARCHITECTURE.md "Schedules").
--
-- A schedule runs a catalog playbook with a payload on a cron expression (in a time zone)
-- or every fixed interval. Its durable state is `next_tick`, the earliest tick not yet
-- decided. The reaper holding the schedule's shard (reaper lease `shard_id`) decides the due
-- ticks in ONE transaction fenced on that lease: it records each fired tick here (one row
-- per (schedule, tick): the primary key makes a second firing impossible) and moves
-- `next_tick` on. It then submits each recorded tick with the idempotency key
-- `schedule/<schedule_id>/<tick ms>`, so a crash between recording and submitting
-- re-submits the same key and gets the same execution.
--
-- Privileges the roles need (for a per-role grant matrix): api: schedule SELECT, INSERT,
-- UPDATE, DELETE, schedule_schedule_id_seq USAGE, schedule_tick SELECT (a DELETE cascades
-- as the owner); reaper: schedule SELECT, UPDATE (it locks rows FOR UPDATE), schedule_tick
-- SELECT, INSERT, UPDATE.
CREATE TABLE noetl.schedule (
  schedule_id      bigserial   PRIMARY KEY,
  name             text        NOT NULL UNIQUE,
  shard_id         int         NOT NULL,
  catalog_path     text        NOT NULL,
  catalog_version  int         NOT NULL DEFAULT 0,        -- 0: the latest version at each tick
  payload          jsonb       NOT NULL DEFAULT '{}'::jsonb,
  cron             text,
  time_zone        text        NOT NULL DEFAULT 'UTC',
  interval_ms      bigint,
  catch_up         text        NOT NULL CHECK (catch_up IN ('skip', 'once', 'all')),
  paused           boolean     NOT NULL DEFAULT false,
  next_tick        timestamptz NOT NULL,
  created_at       timestamptz NOT NULL DEFAULT now(),
  updated_at       timestamptz NOT NULL DEFAULT now(),
  created_by       bigint,                                 -- the token that added it
  CHECK ((cron IS NULL) <> (interval_ms IS NULL)),
  CHECK (interval_ms IS NULL OR interval_ms > 0)
);
CREATE INDEX idx_schedule_due ON noetl.schedule (shard_id, next_tick) WHERE NOT paused;

-- One row per fired tick. `execution_id` is set once the submission answered; `error` when
-- the api refused it for good (e.g. the playbook's path no longer in the catalog).
CREATE TABLE noetl.schedule_tick (
  schedule_id   bigint      NOT NULL REFERENCES noetl.schedule (schedule_id) ON DELETE CASCADE,
  tick          timestamptz NOT NULL,
  fired_at      timestamptz NOT NULL DEFAULT now(),
  shard_id      int         NOT NULL,
  epoch         bigint      NOT NULL,                      -- the reaper lease term that fired it
  execution_id  bigint,
  submitted_at  timestamptz,
  error         text,
  PRIMARY KEY (schedule_id, tick)
);
CREATE INDEX idx_schedule_tick_pending ON noetl.schedule_tick (shard_id, tick)
  WHERE execution_id IS NULL AND error IS NULL;
