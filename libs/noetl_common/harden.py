"""Keep a process's secrets away from the code it runs (the worker runs users' tasks).

``/proc/<pid>/environ`` shows the environment a process was *started* with, whatever it
does to ``os.environ`` later, and a task's code runs as the worker's user. So a process
that holds secrets in its environment at start re-executes itself once, moving them into
an anonymous memory file (``memfd``) whose descriptor it reads and closes at once:
the new image's ``/proc/<pid>/environ`` has none of them. It also marks itself not
dumpable (``PR_SET_DUMPABLE 0``: another process of the same user cannot read its
memory or its /proc files), and drops the secrets from ``os.environ`` once its settings
are read, so no child inherits them.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import sys
from collections.abc import Iterable

logger = logging.getLogger(__name__)

# Variables whose values are secrets (or carry them, like a DSN or a URL with a password).
SECRET_ENV = ("NOETL_POSTGRES_DSN", "NOETL_NATS_URL", "NOETL_AUTH_TOKEN", "NOETL_RESULT_S3_SECRET_KEY",
              "NOETL_RESULT_S3_ACCESS_KEY", "NOETL_CREDENTIALS_KEYS", "NOETL_OTEL_ENDPOINT",
              "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS")
FD_ENV = "NOETL_SECRETS_FD"
PR_SET_DUMPABLE = 4


def _secret_names(environ: Iterable[str]) -> list[str]:
    return [n for n in environ if n in SECRET_ENV]


def reexec_without_secrets_in_environ() -> None:
    """Called first thing in a role's main(): move secrets out of the startup environment
    (re-executing once), or take them back from the memfd after the re-exec. No-op where
    memfd is unavailable (not Linux): logged."""
    fd_text = os.environ.pop(FD_ENV, "")
    if fd_text:
        fd = int(fd_text)
        with os.fdopen(fd, "r") as fh:  # closes the descriptor: nothing left in /proc/<pid>/fd
            os.environ.update(json.load(fh))
        return
    names = _secret_names(os.environ)
    if not names or not hasattr(os, "memfd_create"):
        return
    fd = os.memfd_create("noetl-secrets", 0)  # no CLOEXEC: it survives the exec
    os.write(fd, json.dumps({n: os.environ[n] for n in names}).encode())
    os.lseek(fd, 0, os.SEEK_SET)
    env = {k: v for k, v in os.environ.items() if k not in names}
    env[FD_ENV] = str(fd)
    argv = [sys.executable, *getattr(sys, "orig_argv", sys.argv)[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)


def not_dumpable() -> bool:
    """prctl(PR_SET_DUMPABLE, 0); False where it is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def forget_secret_env() -> None:
    """Drop the secrets from ``os.environ`` (after the settings were read from it)."""
    for name in _secret_names(list(os.environ)):
        del os.environ[name]
