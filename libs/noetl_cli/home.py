"""Where the CLI finds things: the project-local home directory, the local stack's
state file, the api address and the database DSN.

Resolution orders (first hit wins):
  home:         ``--home``, ``$NOETL_HOME``, ``./.noetl``
  api address:  ``--api``, ``$NOETL_API``, ``"api"`` in ``<home>/dev/state.json``
  shard-manager: ``--shard-manager``, ``$NOETL_SHARD_MANAGER_TARGET``, ``"shard_manager"`` in the state file
  database DSN: ``--dsn``, ``$NOETL_POSTGRES_DSN``, ``"postgres_dsn"`` in the state file
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .output import CliError

DEFAULT_HOME = ".noetl"
STATE_FILE = "state.json"


def resolve_home(flag: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None) -> Path:
    """The home directory as an absolute path (it need not exist yet)."""
    env = os.environ if environ is None else environ
    base = Path(cwd) if cwd is not None else Path.cwd()
    chosen = flag or env.get("NOETL_HOME") or DEFAULT_HOME
    path = Path(chosen).expanduser()
    return (path if path.is_absolute() else base / path).resolve()


def dev_dir(home: str | os.PathLike[str]) -> Path:
    return Path(home) / "dev"


def state_path(home: str | os.PathLike[str]) -> Path:
    return dev_dir(home) / STATE_FILE


def read_state(home: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The recorded local stack, or None when there is none (or the file is unreadable)."""
    try:
        data = json.loads(state_path(home).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_state(home: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    """Write the state file atomically."""
    path = state_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


@dataclass(frozen=True)
class Resolved:
    """A resolved setting and where it came from (for error messages); ``local``: from
    the local stack's state file."""

    value: str
    source: str
    local: bool = False


def _resolve(flag: str | None, home: str | os.PathLike[str], environ: Mapping[str, str] | None, *,
             option: str, env_name: str, state_key: str, missing: str) -> Resolved:
    """``option``'s value, else ``$env_name``, else ``state_key`` of the local stack's state file."""
    env = os.environ if environ is None else environ
    if flag:
        return Resolved(flag, option)
    if env.get(env_name):
        return Resolved(env[env_name], env_name)
    state = read_state(home)
    if state and state.get(state_key):
        return Resolved(str(state[state_key]), f"the local stack ({state_path(home)})", local=True)
    raise CliError(f"{missing}: pass {option} {'DSN' if option == '--dsn' else 'HOST:PORT'}, set {env_name}, or start "
                   f"a local stack with `noetl-rt dev up` (looked for {state_path(home)})", code=2)


def resolve_api(flag: str | None, home: str | os.PathLike[str],
                environ: Mapping[str, str] | None = None) -> Resolved:
    return _resolve(flag, home, environ, option="--api", env_name="NOETL_API", state_key="api",
                    missing="no api address")


def resolve_dsn(flag: str | None, home: str | os.PathLike[str],
                environ: Mapping[str, str] | None = None) -> Resolved:
    return _resolve(flag, home, environ, option="--dsn", env_name="NOETL_POSTGRES_DSN", state_key="postgres_dsn",
                    missing="no database")


def resolve_shard_manager(flag: str | None, home: str | os.PathLike[str],
                          environ: Mapping[str, str] | None = None) -> Resolved:
    return _resolve(flag, home, environ, option="--shard-manager", env_name="NOETL_SHARD_MANAGER_TARGET",
                    state_key="shard_manager", missing="no shard-manager address")
