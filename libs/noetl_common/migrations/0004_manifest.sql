-- 0004: retention manifests. The compactor turns a finished execution older than the
-- horizon into one noetl.manifest row plus one noetl.manifest_part row per step, in the
-- same fenced transaction that deletes the execution's events. The read models
-- (noetl.execution, noetl.execution_step) and the references (noetl.result_ref) stay.
-- No triggers.

CREATE TABLE noetl.manifest (
  execution_id      bigint PRIMARY KEY,
  shard_id          int         NOT NULL,
  status            text        NOT NULL,
  playbook_path     text,
  playbook_version  int,
  -- the reference of the execution's last accepted result, and the length of its chain
  terminal_ref_id   bigint,
  chain_depth       int         NOT NULL DEFAULT 0,
  step_count        int         NOT NULL,
  ref_count         int         NOT NULL,
  -- events deleted (all compactions of this execution) and the range they covered
  event_count       bigint      NOT NULL,
  event_types       jsonb       NOT NULL DEFAULT '{}'::jsonb,
  first_event_id    bigint,
  last_event_id     bigint,
  last_shard_seq    bigint,
  started_at        timestamptz,
  ended_at          timestamptz,
  compacted_at      timestamptz NOT NULL DEFAULT now(),
  -- the compactor lease (epoch) the manifest was written under
  compactor_epoch   bigint      NOT NULL
);
CREATE INDEX idx_manifest_shard ON noetl.manifest (shard_id, execution_id);

CREATE TABLE noetl.manifest_part (
  execution_id     bigint NOT NULL REFERENCES noetl.manifest (execution_id) ON DELETE CASCADE,
  step             text   NOT NULL,
  status           text   NOT NULL,
  visits           int    NOT NULL DEFAULT 0,
  -- the step's final accepted result: event type (call.done, call.error, loop.done,
  -- command.dead_lettered) and its v3 envelope; for a loop step the loop reference
  event_type       text,
  envelope         jsonb,
  terminal_ref_id  bigint,
  chain_depth      int    NOT NULL DEFAULT 0,
  -- the step's lineage as GetTrace returns it, newest first:
  -- [{ref_id, parent_ref_id, tier, uri, size_bytes, task, command_id, step, sha256, created_at}]
  chain            jsonb  NOT NULL DEFAULT '[]'::jsonb,
  event_count      int    NOT NULL DEFAULT 0,
  PRIMARY KEY (execution_id, step)
);
