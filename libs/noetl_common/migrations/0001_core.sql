-- 0001: the runtime's core schema. Applied by `noetl-rt migrate`, never at import time.
-- No triggers anywhere: projections are computed by services.

CREATE SCHEMA IF NOT EXISTS noetl;

-- splitmix64 finaliser, identical to noetl_common.ids.mix64 (a test pins them together).
-- Unsigned 64-bit arithmetic is done in numeric; xor and shifts on the signed bigint,
-- masking the sign bits that an arithmetic shift drags in.
CREATE OR REPLACE FUNCTION noetl.mix64(v bigint) RETURNS numeric
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
  two64 CONSTANT numeric := 18446744073709551616;
  two63 CONSTANT numeric := 9223372036854775808;
  z bigint := v;
  u numeric;
BEGIN
  z := z # ((z >> 30) & 17179869183);
  u := ((CASE WHEN z < 0 THEN z::numeric + two64 ELSE z::numeric END) * 13787848793156543929) % two64;
  z := (CASE WHEN u >= two63 THEN u - two64 ELSE u END)::bigint;
  z := z # ((z >> 27) & 137438953471);
  u := ((CASE WHEN z < 0 THEN z::numeric + two64 ELSE z::numeric END) * 10723151780598845931) % two64;
  z := (CASE WHEN u >= two63 THEN u - two64 ELSE u END)::bigint;
  z := z # ((z >> 31) & 8589934591);
  RETURN CASE WHEN z < 0 THEN z::numeric + two64 ELSE z::numeric END;
END $$;

CREATE OR REPLACE FUNCTION noetl.shard_for(execution_id bigint, shard_count int) RETURNS int
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT (noetl.mix64(execution_id) % shard_count)::int
$$;

-- Playbooks, versioned per metadata.path.
CREATE TABLE noetl.catalog (
  catalog_id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  path            text        NOT NULL,
  version         int         NOT NULL,
  kind            text        NOT NULL,
  name            text        NOT NULL,
  content         text        NOT NULL,
  content_sha256  text        NOT NULL,
  doc             jsonb       NOT NULL,
  created_at      timestamptz NOT NULL DEFAULT now(),
  UNIQUE (path, version)
);
CREATE INDEX idx_catalog_sha ON noetl.catalog (content_sha256);

-- Named credentials (`auth: <name>`).
CREATE TABLE noetl.credential (
  name        text PRIMARY KEY,
  kind        text        NOT NULL,
  data        jsonb       NOT NULL,
  created_at  timestamptz NOT NULL DEFAULT now(),
  updated_at  timestamptz NOT NULL DEFAULT now()
);

-- Submissions: committed before SubmitExecution answers. Immutable once written.
CREATE TABLE noetl.execution_request (
  execution_id        bigint PRIMARY KEY,
  shard_id            int         NOT NULL,
  catalog_id          bigint      NOT NULL REFERENCES noetl.catalog (catalog_id),
  payload             jsonb       NOT NULL,
  idempotency_key     text UNIQUE,
  parent_execution_id bigint,
  parent_step         text,
  timeout_sec         double precision NOT NULL,
  requested_at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idx_execution_request_shard ON noetl.execution_request (shard_id, execution_id);

-- The append-only event log. Only the shard's engine writes it, one transaction at a
-- time per shard, so shard_seq is gap-free commit order within a shard.
CREATE SEQUENCE noetl.event_id_seq AS bigint;
CREATE TABLE noetl.event (
  execution_id  bigint      NOT NULL,
  event_id      bigint      NOT NULL DEFAULT nextval('noetl.event_id_seq'),
  shard_id      int         NOT NULL,
  shard_seq     bigint      NOT NULL,
  event_type    text        NOT NULL,
  step          text,
  command_id    text,
  result        jsonb,
  meta          jsonb       NOT NULL DEFAULT '{}'::jsonb,
  created_at    timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (execution_id, event_id),
  -- Envelope v3: references, never payloads.
  CONSTRAINT chk_event_result_shape CHECK (
    result IS NULL OR (
      jsonb_typeof(result) = 'object'
      AND result ? 'status'
      AND (result - ARRAY['status', 'reference', 'parent_ref', 'context', 'error']) = '{}'::jsonb
    )
  )
) PARTITION BY RANGE (execution_id);
CREATE INDEX idx_event_shard_seq ON noetl.event (shard_id, shard_seq);
-- First terminal result per command wins; later ones are recorded as call.duplicate.
CREATE UNIQUE INDEX uidx_event_accepted_result ON noetl.event (execution_id, command_id)
  WHERE event_type IN ('call.done', 'call.error');
CREATE UNIQUE INDEX uidx_event_terminal ON noetl.event (execution_id, event_type)
  WHERE event_type IN ('playbook.completed', 'playbook.failed', 'playbook.cancelled');

-- The engine's compact routing state per execution (counters, pending set; never payloads).
CREATE TABLE noetl.engine_state (
  execution_id    bigint PRIMARY KEY,
  shard_id        int         NOT NULL,
  status          text        NOT NULL,
  state           jsonb       NOT NULL,
  deadline        timestamptz,
  last_shard_seq  bigint      NOT NULL,
  updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idx_engine_state_deadline ON noetl.engine_state (shard_id, deadline)
  WHERE status = 'running';

-- The work queue. Deterministic ids: (execution, step, visit[, loop instance, iteration]).
CREATE TABLE noetl.command (
  command_id    text PRIMARY KEY,
  execution_id  bigint      NOT NULL,
  shard_id      int         NOT NULL,
  catalog_id    bigint      NOT NULL,
  step          text        NOT NULL,
  kind          text        NOT NULL,
  status        text        NOT NULL,
  attempt       int         NOT NULL DEFAULT 1,
  context       jsonb       NOT NULL,
  timeout_sec   double precision NOT NULL DEFAULT 0,
  worker_id     text,
  claimed_at    timestamptz,
  lease_until   timestamptz,
  progress      jsonb,
  created_at    timestamptz NOT NULL DEFAULT now(),
  updated_at    timestamptz NOT NULL DEFAULT now(),
  CONSTRAINT chk_command_status CHECK (status IN ('queued', 'claimed', 'done', 'failed', 'cancelled', 'dead'))
);
CREATE INDEX idx_command_execution ON noetl.command (execution_id);
CREATE INDEX idx_command_open ON noetl.command (shard_id, status, lease_until)
  WHERE status IN ('queued', 'claimed');

-- Membership: one row per process lifetime.
CREATE TABLE noetl.runtime (
  runtime_id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  role             text        NOT NULL,
  instance         text        NOT NULL,
  address          text,
  metrics_address  text,
  pid              int,
  node_id          int,
  status           text        NOT NULL DEFAULT 'alive',
  started_at       timestamptz NOT NULL DEFAULT now(),
  heartbeat_at     timestamptz NOT NULL DEFAULT now(),
  CONSTRAINT chk_runtime_status CHECK (status IN ('alive', 'left', 'dead'))
);
CREATE UNIQUE INDEX uidx_runtime_node ON noetl.runtime (node_id) WHERE status = 'alive';
CREATE INDEX idx_runtime_role ON noetl.runtime (role, status);

-- Shard ownership per role, fenced by epoch.
CREATE TABLE noetl.shard_lease (
  role              text   NOT NULL,
  shard_id          int    NOT NULL,
  owner_runtime_id  bigint,
  epoch             bigint NOT NULL DEFAULT 0,
  leased_until      timestamptz,
  -- engine only: last NATS stream sequence folded, last shard_seq appended,
  -- and the execution id below which every submission of the shard was started.
  stream_seq        bigint NOT NULL DEFAULT 0,
  event_seq         bigint NOT NULL DEFAULT 0,
  sweep_from        bigint NOT NULL DEFAULT 0,
  updated_at        timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (role, shard_id)
);

-- Leader election among shard-manager replicas.
CREATE TABLE noetl.leader_lease (
  name               text PRIMARY KEY,
  holder_runtime_id  bigint,
  holder_instance    text,
  epoch              bigint NOT NULL DEFAULT 0,
  leased_until       timestamptz
);

-- Read models, built by the projector only.
CREATE TABLE noetl.execution (
  execution_id         bigint PRIMARY KEY,
  shard_id             int         NOT NULL,
  catalog_id           bigint,
  playbook_path        text,
  playbook_version     int,
  parent_execution_id  bigint,
  status               text        NOT NULL,
  error                text,
  created_at           timestamptz,
  started_at           timestamptz,
  ended_at             timestamptz,
  updated_at           timestamptz NOT NULL DEFAULT now(),
  last_shard_seq       bigint      NOT NULL DEFAULT 0
);
CREATE INDEX idx_execution_status ON noetl.execution (status, execution_id);
CREATE INDEX idx_execution_path ON noetl.execution (playbook_path, execution_id);

CREATE TABLE noetl.execution_step (
  execution_id   bigint NOT NULL,
  step           text   NOT NULL,
  status         text   NOT NULL,
  visits         int    NOT NULL DEFAULT 0,
  attempts       int    NOT NULL DEFAULT 0,
  result_ref_id  bigint,
  error          text,
  started_at     timestamptz,
  ended_at       timestamptz,
  PRIMARY KEY (execution_id, step)
);

CREATE TABLE noetl.projection_checkpoint (
  shard_id           int PRIMARY KEY,
  last_shard_seq     bigint NOT NULL DEFAULT 0,
  last_projected_at  timestamptz,
  lag_ms             int
);

CREATE TABLE noetl.checkpoint (
  shard_id        int    NOT NULL,
  epoch           bigint NOT NULL,
  last_shard_seq  bigint NOT NULL,
  sealed_at       timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (shard_id, epoch)
);

-- Result store: references (the linked list) and, for the db tier, payloads.
CREATE TABLE noetl.result_ref (
  ref_id         bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
  execution_id   bigint      NOT NULL,
  step           text,
  command_id     text,
  task           text,
  tier           text        NOT NULL,
  uri            text        NOT NULL,
  size_bytes     bigint      NOT NULL,
  content_type   text        NOT NULL DEFAULT 'application/json',
  sha256         text,
  parent_ref_id  bigint REFERENCES noetl.result_ref (ref_id),
  created_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idx_result_ref_execution ON noetl.result_ref (execution_id);
CREATE INDEX idx_result_ref_parent_chain ON noetl.result_ref (parent_ref_id) WHERE parent_ref_id IS NOT NULL;

CREATE TABLE noetl.result_payload (
  ref_id  bigint PRIMARY KEY REFERENCES noetl.result_ref (ref_id) ON DELETE CASCADE,
  data    bytea NOT NULL
);
