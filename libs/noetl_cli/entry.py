"""The ``noetl-rt`` program (the console script and ``python -m noetl_cli``): ``main`` run
as a process, with the start-up and exit a short command should have
(docs/ARCHITECTURE.md "CLI start-up").

- The cyclic garbage collector is off while the modules load: the tens of thousands of
  objects they make (grpc, protobuf, the generated descriptors) live until the process
  ends, and each full collection during the imports walked all of them again. They are
  then frozen (``gc.freeze``: left out of later collections) and the collector is on
  again for the command itself (``watch`` and ``dev up`` may run for hours).
- At the end, once stdout and stderr are flushed and the exit handlers have run, the
  process ends with ``os._exit``: the interpreter's own finalisation (a last collection,
  tearing down every module, grpc's and ssl's objects) does nothing a finished command
  needs. It is taken only when no other non-daemon thread is alive and the flushes
  succeeded; otherwise the exit is the ordinary ``sys.exit``.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading


def run() -> None:
    gc.disable()
    try:
        from .main import main
    finally:
        gc.freeze()
        gc.enable()
    code = main()
    if _others_alive():
        sys.exit(code)
    atexit._run_exitfuncs()
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:  # None: the process was started with the descriptor closed
                stream.flush()
    except (OSError, ValueError):
        sys.exit(code)  # the interpreter reports a failed flush its own way
    os._exit(code)


def _others_alive() -> bool:
    """Whether a non-daemon thread other than this one is running (the interpreter would
    wait for it)."""
    me = threading.current_thread()
    return any(t is not me and t.is_alive() and not t.daemon for t in threading.enumerate())
