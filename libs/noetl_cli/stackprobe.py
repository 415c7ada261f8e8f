"""What a client command needs to know about the local stack, read from its state file
without the launcher's imports (``devstack`` pulls in Postgres, NATS and certificate
code: most of a one-RPC command's start-up; docs/ARCHITECTURE.md "CLI start-up"): which parts
are dead, the admin token and the CA to trust."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from . import stacksecrets
from .home import dev_dir, read_state
from .output import CliError
from .procs import same_process

# stackcerts.DIR, stackcerts.CA (stackcerts loads cryptography: pinned by a unit test)
CA_FILE = ("tls", "ca.crt")


def _alive(info: Mapping[str, Any]) -> bool:
    return same_process(int(info.get("pid") or 0), int(info.get("started") or 0))


def stack_trouble(home: Path, when: Collection[str] | None = None) -> str:
    """What is wrong with the local stack recorded under ``home``, as one sentence that
    says how to fix it: every part whose process is gone. '' when nothing is (or no
    stack is recorded; a part without a recorded pid is not judged), and with ``when``
    (``postgres``, ``nats``, role names) also when none of those parts is gone."""
    state = read_state(home)
    if state is None:
        return ""
    dead: list[tuple[str, str, int]] = []  # (role, name, pid)
    for name in ("postgres", "nats"):
        info = state.get(name) or {}
        if isinstance(info, Mapping) and info.get("pid") and not _alive(info):
            dead.append((name, name, int(info["pid"])))
    for role, procs in (state.get("services") or {}).items():
        for index, proc in enumerate(procs or []):
            if proc.get("pid") and not _alive(proc):
                dead.append((role, str(proc.get("instance") or f"{role}-{proc.get('index', index)}"),
                             int(proc["pid"])))
    if not dead or (when is not None and not any(role in when for role, _, _ in dead)):
        return ""
    if len(dead) == 1:
        _, name, pid = dead[0]
        return f"the local stack's {name} is not running (pid {pid}); `noetl-rt dev up` restarts it in place (data kept)"
    named = [f"{name} (pid {pid})" for _, name, pid in dead]
    listed = ", ".join(named[:-1]) + f" and {named[-1]}"
    return f"the local stack's {listed} are not running; `noetl-rt dev up` restarts them in place (data kept)"


def resolve_token(home: Path, token_file: str | None, local: bool,
                  environ: Mapping[str, str] | None = None) -> str:
    """The token a client command sends ('' when none is configured)."""
    env = os.environ if environ is None else environ
    if token_file:
        try:
            return Path(token_file).read_text().strip()
        except OSError as exc:
            raise CliError(f"cannot read --token-file {token_file}: {exc}", code=2) from None
    if env.get("NOETL_TOKEN"):
        return env["NOETL_TOKEN"].strip()
    if local:
        return stacksecrets.tokens(dev_dir(home)).get("admin", "")
    return ""


def resolve_ca(home: Path, local: bool, environ: Mapping[str, str] | None = None) -> str:
    """The CA a client trusts: ``$NOETL_TLS_CA_FILE``, else the local stack's when it talks
    to it ('' = plaintext)."""
    env = os.environ if environ is None else environ
    if env.get("NOETL_TLS_CA_FILE"):
        return env["NOETL_TLS_CA_FILE"]
    if local:
        ca = dev_dir(home).joinpath(*CA_FILE)
        return str(ca) if ca.exists() else ""
    return ""
