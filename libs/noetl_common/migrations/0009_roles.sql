-- 0009: least privilege (docs/DEPLOY.md "Database users"). Each role process connects as
-- its own login user, a member of its NOLOGIN group role below. What each group role may
-- do is the matrix in noetl_common/dbroles.py, applied by `migrate` after the migrations
-- (every time, idempotently). Role names are cluster-wide.

-- The group roles, created when the owner may (CREATEROLE); otherwise the operator
-- creates them before migrating (their grants are skipped, with a warning, until then).
DO $$
DECLARE
  r text;
  may boolean := (SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user);
BEGIN
  FOREACH r IN ARRAY ARRAY['noetl_api', 'noetl_shard_manager', 'noetl_projector', 'noetl_checkpointer',
                           'noetl_compactor', 'noetl_reaper', 'noetl_worker'] LOOP
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
      IF may THEN
        EXECUTE format('CREATE ROLE %I NOLOGIN', r);
      ELSE
        RAISE WARNING 'role % does not exist and % may not create it', r, current_user;
      END IF;
    END IF;
  END LOOP;
  -- The shard-manager's leader ends the session of a dead member still holding a lease
  -- row (pg_terminate_backend of another role's backend).
  IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'noetl_shard_manager') THEN
    IF (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
       OR pg_has_role(current_user, 'pg_signal_backend', 'MEMBER WITH ADMIN OPTION') THEN
      GRANT pg_signal_backend TO noetl_shard_manager;
    ELSE
      RAISE WARNING 'grant pg_signal_backend to noetl_shard_manager (% may not)', current_user;
    END IF;
  END IF;
END $$;

-- Nothing in schema noetl is anyone's by default.
REVOKE CREATE ON SCHEMA noetl FROM PUBLIC;
ALTER DEFAULT PRIVILEGES IN SCHEMA noetl REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;

-- A token's identity by its SHA-256 (every role's gRPC servers check tokens); only the
-- api reads or writes noetl.api_token itself, so a role's login reads no token hashes.
CREATE FUNCTION noetl.token_identity(p_sha256 text)
RETURNS TABLE (token_id bigint, name text, role text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
  SELECT t.token_id, t.name, t.role FROM noetl.api_token t
   WHERE t.token_sha256 = p_sha256 AND t.revoked_at IS NULL
$$;

-- Event partitions: the day's partition of noetl.event (snowflake bounds, as
-- noetl_common.ids.snowflake_at: ms since 2024-01-01 shifted by 22 bits), created by the
-- owner on the compactor's behalf (creating a partition needs the parent's ownership).
-- Returns the partition's name when it created it, NULL when it existed.
CREATE FUNCTION noetl.create_event_partition(p_day date)
RETURNS text LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
  part text := 'event_p' || to_char(p_day, 'YYYYMMDD');
  lo bigint := ((extract(epoch FROM p_day::timestamp)::bigint * 1000) - 1704067200000) << 22;
  hi bigint := ((extract(epoch FROM (p_day + 1)::timestamp)::bigint * 1000) - 1704067200000) << 22;
BEGIN
  PERFORM pg_advisory_xact_lock(474315322477);  -- noetl_common.db.PARTITION_LOCK_KEY
  IF EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = 'noetl' AND c.relname = part) THEN
    RETURN NULL;
  END IF;
  EXECUTE format('CREATE TABLE noetl.%I PARTITION OF noetl.event FOR VALUES FROM (%s) TO (%s)', part, lo, hi);
  RETURN part;
END $$;

-- Drop an event partition if it is empty (the compactor decides which have expired).
-- Checks emptiness first without locking the log, then under the partition lock and the
-- parent's ACCESS EXCLUSIVE lock (the order an INSERT takes them), waiting at most 2 s
-- for it (lock_not_available otherwise: tried again next round). Returns true if dropped.
CREATE FUNCTION noetl.drop_event_partition(p_name text)
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
  empty boolean;
BEGIN
  IF p_name !~ '^event_p[0-9]{8}$' OR NOT EXISTS (
       SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = 'noetl.event'::regclass AND c.relname = p_name
          AND c.relnamespace = 'noetl'::regnamespace) THEN
    RAISE EXCEPTION 'not an event partition: %', p_name USING ERRCODE = 'invalid_parameter_value';
  END IF;
  EXECUTE format('SELECT NOT EXISTS (SELECT 1 FROM noetl.%I)', p_name) INTO empty;
  IF NOT empty THEN
    RETURN false;
  END IF;
  PERFORM set_config('lock_timeout', '2s', true);
  PERFORM pg_advisory_xact_lock(474315322477);
  LOCK TABLE noetl.event IN ACCESS EXCLUSIVE MODE;
  EXECUTE format('SELECT NOT EXISTS (SELECT 1 FROM noetl.%I)', p_name) INTO empty;
  IF NOT empty THEN
    RETURN false;
  END IF;
  EXECUTE format('DROP TABLE noetl.%I', p_name);
  RETURN true;
END $$;
