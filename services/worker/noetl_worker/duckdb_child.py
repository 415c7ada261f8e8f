"""The duckdb tool's work, run inside a python sandbox child (``noetl_worker.sandbox``).

The worker never opens DuckDB itself: DuckDB runs untrusted SQL that can read and write
files and open network connections (ATTACH ... TYPE postgres), so it runs where python
task code runs, in a child interpreter with the task limits (memory, timeout: the child is
killed) and without the worker's secrets or memory. ``tools/duckdb.py`` sends
:data:`CHILD_CODE` with the task's spec as input; this module does the rest.

    spec = {"sql": str, "params": list | None, "database": str (":memory:" or a file path),
            "secrets": [{"name", "type", "fields"}], "default_secret": bool,
            "ext_dir": str, "result_bytes": int, "memory_limit_mb": int, "threads": int}

Statements run one at a time in order (DuckDB's own parser splits them, so a ``;`` inside
a string literal is not a split point). The value, like the postgres tool's, describes the
last statement that returned rows (``{"status": "ok", "rows": [{col: value}], "row_count",
"columns"}``), else ``{"status": "ok", "row_count"}`` with the rows the last INSERT /
UPDATE / DELETE / COPY changed (0 when none ran). ``params`` bind to a single statement.

Rows are converted ``FETCH_ROWS`` at a time and their encoded size counted; past
``result_bytes`` the task stops with :class:`ResultTooLarge` (the pool's
``RESULT_TOO_LARGE``) without converting the rest.

Credentials become DuckDB secrets (``CREATE OR REPLACE TEMPORARY SECRET``: in memory,
never written to disk): a postgres credential named by the task is a ``TYPE postgres``
secret, so ``ATTACH '' AS db (TYPE postgres, SECRET <alias>)`` uses it (or ``ATTACH ''
AS db (TYPE postgres)`` for the one credential of a task, which is also the default
secret). The postgres extension comes from the ``duckdb-extension-postgres`` wheel:
``ext_dir`` is made a DuckDB extension directory holding it, so ``INSTALL postgres;
LOAD postgres;`` in a playbook finds it installed and nothing is downloaded
(``autoinstall_known_extensions`` is off).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

FETCH_ROWS = 1000
POSTGRES_EXTENSION = "postgres_scanner"
# Statement types whose result is rows a reader wants; the DML types answer a row count.
ROW_TYPES = ("SELECT", "EXPLAIN", "PRAGMA", "CALL", "EXECUTE", "RELATION")
COUNT_TYPES = ("INSERT", "UPDATE", "DELETE", "MERGE_INTO", "COPY")

CHILD_CODE = "from noetl_worker.duckdb_child import run as _noetl_duckdb_run\nreturn _noetl_duckdb_run(input_data)\n"


class ResultTooLarge(Exception):
    """The rows' encoded size passed the result limit (the sandbox reports the kind)."""


class DuckdbSetupError(Exception):
    """The task's credentials or extensions could not be set up in DuckDB."""


def quote_literal(value: Any) -> str:
    return "'" + str(value).replace("'", "''") + "'"


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def postgres_secret_sql(name: str | None, fields: Mapping[str, Any]) -> str:
    """``CREATE OR REPLACE TEMPORARY SECRET`` of TYPE postgres from a credential's fields
    (``host``/``port``/``user``/``password``/``dbname`` in the spellings the postgres tool
    accepts, or a ``dsn``: libpq key=value or a postgresql:// URL). ``name`` None: the
    default postgres secret."""
    from psycopg.conninfo import conninfo_to_dict

    params: dict[str, Any] = {}
    dsn = fields.get("dsn") or fields.get("conninfo") or fields.get("url")
    if dsn:
        params.update({k: v for k, v in conninfo_to_dict(str(dsn)).items() if v is not None})
    aliases = {"host": ("host", "db_host", "hostname"), "port": ("port", "db_port"),
               "user": ("user", "username", "db_user"), "password": ("password", "db_password"),
               "dbname": ("dbname", "database", "db_name", "db"), "sslmode": ("sslmode", "ssl_mode")}
    for key, names in aliases.items():
        for n in names:
            if fields.get(n) not in (None, ""):
                params[key] = fields[n]
                break
    if not params.get("host") and not params.get("dbname"):
        raise DuckdbSetupError("postgres credential has neither `dsn` nor host/dbname")
    parts = ["TYPE postgres"]
    for key, option in (("host", "HOST"), ("port", "PORT"), ("dbname", "DATABASE"), ("user", "USER"),
                        ("password", "PASSWORD")):
        if params.get(key) not in (None, ""):
            parts.append(f"{option} {quote_literal(params[key])}")
    head = f"CREATE OR REPLACE TEMPORARY SECRET {quote_ident(name)}" if name else \
        "CREATE OR REPLACE TEMPORARY SECRET"
    return f"{head} ({', '.join(parts)})"


# libpq connection settings a DuckDB postgres secret has no option for, given to the
# extension's libpq through its environment variables (this child runs one task).
LIBPQ_ENV = {"sslmode": "PGSSLMODE", "sslrootcert": "PGSSLROOTCERT", "sslcert": "PGSSLCERT",
             "sslkey": "PGSSLKEY", "passfile": "PGPASSFILE"}


def libpq_env(secrets: list[Mapping[str, Any]]) -> dict[str, str]:
    """The ``PG*`` variables of the secrets' TLS and passfile settings (from a ``dsn`` or
    the fields); two secrets that disagree on one are refused naming it (libpq's
    environment holds one value for the whole task)."""
    from psycopg.conninfo import conninfo_to_dict

    env: dict[str, str] = {}
    for secret in secrets:
        fields = secret.get("fields") or {}
        params: dict[str, Any] = {}
        dsn = fields.get("dsn") or fields.get("conninfo") or fields.get("url")
        if dsn:
            params.update(conninfo_to_dict(str(dsn)))
        params.update({k: fields[k] for k in LIBPQ_ENV if fields.get(k) not in (None, "")})
        if fields.get("ssl_mode") and "sslmode" not in params:
            params["sslmode"] = fields["ssl_mode"]
        for key, var in LIBPQ_ENV.items():
            value = params.get(key)
            if value in (None, ""):
                continue
            if env.get(var, str(value)) != str(value):
                raise DuckdbSetupError(f"the task's postgres credentials disagree on {key}: one task attaches"
                                       " databases with one TLS/passfile setting")
            env[var] = str(value)
    return env


def prepare_extensions(ext_dir: str, version: str, platform: str) -> bool:
    """Make ``ext_dir`` a DuckDB extension directory holding the postgres extension of the
    installed wheel (a symlink, replaced atomically); False when the wheel is not installed."""
    try:
        import duckdb_extension_postgres
    except ImportError:
        return False
    base = os.path.join(os.path.dirname(duckdb_extension_postgres.__file__), "extensions", version)
    source = os.path.join(base, "postgres.duckdb_extension")
    if not os.path.isfile(source):
        return False
    target_dir = os.path.join(ext_dir, version, platform)
    os.makedirs(target_dir, mode=0o700, exist_ok=True)
    target = os.path.join(target_dir, f"{POSTGRES_EXTENSION}.duckdb_extension")
    if os.path.realpath(target) != os.path.realpath(source):
        tmp = f"{target}.{os.getpid()}.tmp"
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(source, tmp)
        os.replace(tmp, target)
    return True


def _connect(spec: Mapping[str, Any]) -> Any:
    import duckdb

    config: dict[str, Any] = {"autoinstall_known_extensions": False, "autoload_known_extensions": True}
    if spec.get("threads"):
        config["threads"] = int(spec["threads"])
    if spec.get("memory_limit_mb"):
        config["memory_limit"] = f"{int(spec['memory_limit_mb'])}MB"
    ext_dir = str(spec.get("ext_dir") or "")
    if ext_dir:
        config["extension_directory"] = ext_dir
    conn = duckdb.connect(str(spec.get("database") or ":memory:"), config=config)
    try:
        if ext_dir:
            version = (conn.execute("PRAGMA version").fetchone() or ("",))[0]
            platform = (conn.execute("PRAGMA platform").fetchone() or ("",))[0]
            have_pg = prepare_extensions(ext_dir, str(version), str(platform))
        else:
            have_pg = False
        secrets = list(spec.get("secrets") or [])
        if secrets:
            if not have_pg:
                raise DuckdbSetupError("the duckdb postgres extension is not installed on this worker "
                                       "(the duckdb-extension-postgres package)")
            conn.execute(f"LOAD {POSTGRES_EXTENSION}")
        for secret in secrets:
            if secret.get("type") != "postgres":
                raise DuckdbSetupError(f"credential of kind {secret.get('type')!r} cannot be used by duckdb "
                                       "(supported: postgres)")
            conn.execute(postgres_secret_sql(secret.get("name"), secret.get("fields") or {}))
            if spec.get("default_secret"):
                conn.execute(postgres_secret_sql(None, secret.get("fields") or {}))
    except BaseException:
        conn.close()
        raise
    return conn


def _fetch_rows(cur: Any, limit: int) -> tuple[list[dict[str, Any]], list[str]]:
    from noetl_common.codec import json_default

    columns = [d[0] for d in cur.description or []]
    rows: list[dict[str, Any]] = []
    size = 2
    while batch := cur.fetchmany(FETCH_ROWS):
        dicts = [dict(zip(columns, row, strict=False)) for row in batch]
        data = json.dumps(dicts, default=json_default, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
        size += len(data.encode()) - 1
        if limit and size > limit:
            raise ResultTooLarge(f"the rows are more than {limit} bytes")
        rows.extend(json.loads(data))
    return rows, columns


def run(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Run the task described by ``spec`` (module docstring) and return its value."""
    sql = str(spec.get("sql") or "")
    limit = int(spec.get("result_bytes") or 0)
    pg_env = libpq_env(list(spec.get("secrets") or []))
    saved_env = {var: os.environ.get(var) for var in pg_env}
    os.environ.update(pg_env)
    try:
        return _run(spec, sql, limit)
    finally:
        for var, value in saved_env.items():  # the child may run another task next
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def _run(spec: Mapping[str, Any], sql: str, limit: int) -> dict[str, Any]:
    conn = _connect(spec)
    try:
        params = spec.get("params")
        statements = conn.extract_statements(sql)
        if params and len(statements) != 1:
            raise DuckdbSetupError(f"`params` bind to a single statement; the query has {len(statements)}")
        rows_result: dict[str, Any] | None = None
        changed = 0
        for statement in statements:
            kind = statement.type.name
            cur = conn.execute(statement.query, params) if params else conn.execute(statement)
            if kind in COUNT_TYPES:
                row = cur.fetchone()
                changed = int(row[0]) if row and isinstance(row[0], int) else 0
            elif kind in ROW_TYPES and cur.description is not None:
                rows, columns = _fetch_rows(cur, limit)
                rows_result = {"status": "ok", "rows": rows, "row_count": len(rows), "columns": columns}
        if rows_result is not None:
            return rows_result
        return {"status": "ok", "row_count": changed}
    finally:
        conn.close()


__all__ = ["CHILD_CODE", "DuckdbSetupError", "ResultTooLarge", "postgres_secret_sql", "prepare_extensions", "run"]
