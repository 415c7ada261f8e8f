-- 0007: credentials encrypted at rest (docs/ARCHITECTURE.md "Credentials").
--
-- Envelope encryption: each credential's data (its JSON object) is encrypted with a data
-- key of its own (AES-256-GCM, `nonce`, `ciphertext`); the data key is encrypted
-- ("wrapped") with a master key from NOETL_CREDENTIALS_KEYS (`wrapped_key` = nonce +
-- AES-256-GCM ciphertext, `key_id` names the master key). Only the api holds the master
-- keys; this migration cannot encrypt anything. Rows written before it keep their
-- plaintext in `data` until an api with a key starts: it encrypts them (and clears
-- `data`) in its start transaction, before it serves. Afterwards
--   SELECT count(*) FROM noetl.credential WHERE data IS NOT NULL   -- 0
-- and the CHECK below keeps a row either sealed or (legacy) plaintext, never both.
ALTER TABLE noetl.credential
  ALTER COLUMN data DROP NOT NULL,
  ADD COLUMN key_id      text,
  ADD COLUMN wrapped_key bytea,
  ADD COLUMN nonce       bytea,
  ADD COLUMN ciphertext  bytea,
  ADD CONSTRAINT credential_sealed_or_legacy CHECK (
    (data IS NULL AND key_id IS NOT NULL AND wrapped_key IS NOT NULL AND nonce IS NOT NULL
     AND ciphertext IS NOT NULL)
    OR (data IS NOT NULL AND key_id IS NULL AND wrapped_key IS NULL AND nonce IS NULL
        AND ciphertext IS NULL));

COMMENT ON COLUMN noetl.credential.data IS
  'plaintext of a row written before migration 0007 (NULL once the api has encrypted it)';
COMMENT ON COLUMN noetl.credential.key_id IS
  'the NOETL_CREDENTIALS_KEYS entry whose master key wraps this row''s data key';
