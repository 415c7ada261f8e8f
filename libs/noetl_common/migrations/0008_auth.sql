-- 0008: identities (docs/DEPLOY.md "Security").

-- API tokens: only their SHA-256 is kept. A token is `noetl_<random>`; its role decides
-- which RPCs it may call (noetl_common.auth.METHOD_ROLES).
CREATE TABLE noetl.api_token (
  token_id      bigserial PRIMARY KEY,
  name          text        NOT NULL,
  role          text        NOT NULL CHECK (role IN ('admin', 'submit', 'read', 'worker', 'service')),
  token_sha256  text        NOT NULL UNIQUE,
  created_at    timestamptz NOT NULL DEFAULT now(),
  created_by    text,
  revoked_at    timestamptz
);
CREATE UNIQUE INDEX idx_api_token_live_name ON noetl.api_token (name) WHERE revoked_at IS NULL;

-- Keys the runtime generates for itself (e.g. `claim_key`: the api replicas' shared HMAC
-- key of claim tokens).
CREATE TABLE noetl.runtime_secret (
  name        text        PRIMARY KEY,
  value       bytea       NOT NULL,
  created_at  timestamptz NOT NULL DEFAULT now()
);

-- A membership's secret (its SHA-256): Heartbeat and Leave must present it.
ALTER TABLE noetl.runtime ADD COLUMN IF NOT EXISTS member_secret_sha256 text;

-- The token that submitted an execution (a `submit` token may cancel only its own).
ALTER TABLE noetl.execution_request ADD COLUMN IF NOT EXISTS submitted_by bigint;
