"""``python -m bench [--quick|--full]``: run the scenarios, then the peers, then write
``docs/BENCHMARKS.md`` and the plots. ``make bench`` / ``make bench-quick`` call this.

Order: our main stack (raw limits first, on the idle stack, then turnaround, fan-out,
growth, the sequential loop, cursor drain, the PFT flow, concurrency, compactor
throughput), in full mode a second stack with Postgres fsync on (turnaround and fan-out again) and, when
``stack.TUNED_ENV`` is set, a tuned stack (fan-out again), the recovery
stack (2 api replicas, fast failover), then, with every stack of ours stopped, the peers
one after another (Temporal, then Prefect), each in its own virtualenv. A scenario, a
stack or a peer that fails is recorded as such and the run goes on; every process
started is stopped on the way out (Ctrl-C and SIGTERM included). The report is written
either way; the exit status is 0 only if nothing failed (1 otherwise, the failures listed
at the end; 130 when interrupted).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from noetl_common.config import ShardSettings

from . import report
from .machine import ProcSampler, machine_facts
from .peers import runner as peers
from .progress import Progress
from .scenarios import cli, compactor, concurrency, cursor, limits, loops, pft, recovery, turnaround
from .scenarios.common import Ctx, Plan
from .stack import BASE_ENV, FAST_FAILOVER_ENV, RESULTS, TUNED_ENV, BenchStack, reap_stale

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = ("limits", "turnaround", "fanout", "growth", "sequential", "cursor", "pft", "concurrency",
             "compactor", "cli", "durable", "recovery", "peers")


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.plan = Plan.quick() if args.quick else Plan.full()
        if args.peers is not None:
            self.plan = Plan(**{**self.plan.__dict__, "peers": args.peers})
        for item in args.set:
            key, _, value = item.partition("=")
            current = getattr(self.plan, key)
            if isinstance(current, tuple):
                parsed: Any = tuple(int(v) for v in value.split(",") if v)
            elif isinstance(current, bool):
                parsed = value.lower() in ("1", "true", "yes")
            else:
                parsed = type(current)(value)
            self.plan = Plan(**{**self.plan.__dict__, key: parsed})
        self.only = set(args.only.split(",")) if args.only else set(SCENARIOS)
        unknown = self.only - set(SCENARIOS)
        if unknown:
            raise SystemExit(f"--only: unknown scenario(s) {', '.join(sorted(unknown))}; known: {','.join(SCENARIOS)}")
        self.results_dir = Path(args.results).resolve()
        self.t0 = time.monotonic()
        self.progress = Progress()
        self.results: dict[str, Any] = {
            "mode": self.plan.mode, "command": args.command or " ".join(["python -m bench", *sys.argv[1:]]),
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"), "plan": self.plan.__dict__,
            "machine": machine_facts(),
            "settings": {"stack_env": BASE_ENV, "tuned_env": TUNED_ENV, "recovery_env": FAST_FAILOVER_ENV,
                         # the stacks' shard count (their roles read this environment)
                         "shard_count": ShardSettings().count,
                         "recovery_scale": {"api": 2},
                         # the checkpointers' setting (the stack's roles inherit this environment)
                         "checkpoint_interval_ms": int(BASE_ENV.get("NOETL_CHECKPOINT_INTERVAL_MS") or os.environ.get(
                             "NOETL_CHECKPOINT_INTERVAL_MS") or 1000)},
            "scenarios": {}, "peers": {},
        }
        self.log = self.results_dir / "bench.log"

    # ------------------------------------------------------------ helpers

    def attempt(self, name: str, fn: Callable[[], dict[str, Any]], into: dict[str, Any] | None = None) -> None:
        into = self.results["scenarios"] if into is None else into
        t0 = time.monotonic()
        try:
            out = fn()
            into[name] = {"ok": True, **out, "duration_s": round(time.monotonic() - t0, 1)}
            self.progress.say(f"{name}: done in {time.monotonic() - t0:.1f}s")
        except KeyboardInterrupt:
            into[name] = {"ok": False, "error": "interrupted", "duration_s": round(time.monotonic() - t0, 1)}
            raise
        except Exception as exc:
            self.progress.finish()
            into[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                          "duration_s": round(time.monotonic() - t0, 1)}
            with open(self.log, "a") as fh:
                fh.write(f"--- {name}\n{traceback.format_exc()}\n")
            self.progress.say(f"{name}: FAILED: {exc} (traceback in {self.log})")

    def stack_block(self, name: str, wanted: list[str], scenarios: dict[str, Callable[[Ctx], dict[str, Any]]],
                    *, scale: dict[str, int] | None = None, env: dict[str, str] | None = None, fsync: bool = False,
                    into: dict[str, Any] | None = None) -> None:
        todo = [s for s in scenarios if s in wanted]
        if not todo:
            return
        target = self.results["scenarios"] if into is None else into
        t0 = time.monotonic()
        try:
            with BenchStack(name, self.progress, scale=scale, env=env, fsync=fsync,
                            results=self.results_dir) as stack:
                started = time.monotonic() - t0
                ctx = Ctx(stack, self.progress, self.plan)
                with ProcSampler(stack.roots, interval=0.5, flat=frozenset({"bench-client"})) as idle:
                    ctx.background_writes_per_s = stack.write_rate(3.0)
                ctx.background_cores = {k: v["cores"] for k, v in idle.summary()["trees"].items()}
                self.results["scenarios"].setdefault("_stacks", {})[name] = {
                    "background_write_txns_per_s": round(ctx.background_writes_per_s, 1),
                    "background_cores": ctx.background_cores, "scale": scale or {}, "fsync": fsync,
                    "start_s": round(started, 1)}
                ctx.limits = self.results["scenarios"].get("limits", {})
                for s in todo:
                    self.attempt(s, functools.partial(scenarios[s], ctx), into=target)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            with open(self.log, "a") as fh:
                fh.write(f"--- stack {name}\n{traceback.format_exc()}\n")
            for s in todo:
                target.setdefault(s, {"ok": False, "error": f"stack '{name}' failed: {type(exc).__name__}: {exc}"})
            self.progress.say(f"stack '{name}' failed: {exc}")
        finally:
            stacks = self.results["scenarios"].setdefault("_stacks", {})
            stacks.setdefault(name, {})["wall_s"] = round(time.monotonic() - t0, 1)

    def _other_stacks(self) -> list[str]:
        """A local stack of the developer's (`make run`) left running shares the machine."""
        from noetl_cli.devstack import StackState

        notes = []
        with contextlib.suppress(Exception):
            state = StackState.load(REPO / ".noetl")
            if state is not None and state.alive():
                notes.append("a local stack started by `make run` / `noetl-rt dev up` (under .noetl/) was running "
                             "beside the benchmark, idle; its CPU is part of 'other processes'")
        return notes

    # ------------------------------------------------------------ the run

    def run(self) -> int:
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.log.write_text("")
        p = self.progress
        p.say(f"bench ({self.plan.mode}): {', '.join(s for s in SCENARIOS if s in self.only)}")
        reap_stale(p)
        self.results["notes"] = self._other_stacks()
        wanted = [s for s in SCENARIOS if s in self.only]
        fanout_box: dict[str, Any] = {}

        def do_fanout(ctx: Ctx) -> dict[str, Any]:
            fanout_box.update(loops.fanout(ctx))
            return fanout_box

        main: dict[str, Callable[[Ctx], dict[str, Any]]] = {
            "limits": limits.run, "turnaround": turnaround.run, "fanout": do_fanout,
            "growth": lambda ctx: loops.growth(ctx, fanout_box), "sequential": loops.sequential,
            "cursor": cursor.run, "pft": pft.run, "concurrency": concurrency.run, "compactor": compactor.run,
            "cli": cli.run,
        }
        interrupted = False
        try:
            self.stack_block("main", wanted, main, fsync=self.args.fsync)
            if self.plan.durable_rerun and "durable" in wanted and not self.args.fsync:
                durable: dict[str, Any] = {}
                self.results["scenarios"]["durable"] = durable
                self.stack_block("durable", ["turnaround", "fanout"], {
                    "turnaround": lambda ctx: turnaround.run(ctx, "turnaround (fsync on)"),
                    "fanout": lambda ctx: loops.fanout(ctx)}, fsync=True, into=durable)
            if self.plan.tuned_rerun and TUNED_ENV and "fanout" in wanted:
                tuned: dict[str, Any] = {}
                self.results["scenarios"]["tuned"] = tuned
                self.stack_block("tuned", ["fanout"], {"fanout": loops.fanout}, env=TUNED_ENV,
                                 fsync=self.args.fsync, into=tuned)
            self.stack_block("recovery", wanted, {"recovery": recovery.run}, scale={"api": 2},
                             env=FAST_FAILOVER_ENV, fsync=self.args.fsync)
            if "peers" in wanted:
                if self.plan.peers:
                    self.results["peers"] = peers.run_all(self.plan, p, self.results_dir)
                else:
                    self.results["peers"] = {"skipped": "quick mode runs no peers (make bench does)"}
        except KeyboardInterrupt:
            interrupted = True
            p.say("interrupted: every process this run started has been stopped; writing what was measured")
        self.results["finished_at"] = datetime.now(UTC).isoformat(timespec="seconds")
        self.results["interrupted"] = interrupted
        failed = failures(self.results)
        self.results["failures"] = failed
        self.results["duration_s"] = round(time.monotonic() - self.t0, 1)  # measuring, without plots and report
        raw = self.results_dir / f"bench-{self.plan.mode}.json"
        self.results["results_file"] = _shown(raw)
        raw.write_text(json.dumps(self.results, indent=2, default=str))
        p.say(f"raw results: {_shown(raw)}")
        plots: list[str] = []
        if not self.args.no_plots:
            plots = peers.make_plots(raw, Path(self.args.out).parent / "bench", p, self.results_dir)
        out = Path(self.args.out)
        out.write_text(report.render(self.results, plots, out.parent))
        p.say(f"wrote {out} (the run took {report.duration(self.results['duration_s'])})")
        if interrupted:
            return 130
        if failed:
            p.say(f"{len(failed)} failure(s):")
            for f in failed:
                p.say(f"  - {f}")
            return 1
        return 0


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def failures(results: dict[str, Any]) -> list[str]:
    """Every scenario, part of a scenario (a fan-out width, a growth point) or peer that
    did not produce a verified figure."""
    out: list[str] = []

    def one(name: str, d: Any) -> None:
        if not isinstance(d, dict):
            return
        if not d.get("ok"):
            out.append(f"{name}: {d.get('error') or 'failed'}")
            return
        for key, label in (("runs", "max_in_flight"), ("points", "items")):
            for r in d.get(key, []) if isinstance(d.get(key), list) else []:
                if isinstance(r, dict) and r.get("error"):
                    out.append(f"{name} ({label} {r.get(label)}): {r['error']}")

    for name, d in results.get("scenarios", {}).items():
        if name.startswith("_"):
            continue
        if name in ("durable", "tuned"):
            for sub, sd in (d or {}).items():
                one(f"{sub} ({'fsync on' if name == 'durable' else 'tuned'})", sd)
            continue
        one(name, d)
    for name, d in results.get("peers", {}).items():
        if name != "skipped":
            one(f"peer {name}", d)
    return out


def rewrite(raw: Path, args: argparse.Namespace) -> int:
    """The report and plots again from ``raw`` (the derived growth figures recomputed)."""
    results = json.loads(raw.read_text())
    growth = results.get("scenarios", {}).get("growth")
    if isinstance(growth, dict) and growth.get("ok"):
        good = [p for p in growth["points"] if "error" not in p]
        growth.update(loops.shape(good))
        raw.write_text(json.dumps(results, indent=2, default=str))
    progress = Progress()
    plots = [] if args.no_plots else peers.make_plots(raw, Path(args.out).parent / "bench", progress,
                                                      Path(args.results))
    out = Path(args.out)
    out.write_text(report.render(results, plots, out.parent))
    progress.say(f"wrote {out} from {raw}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the short run (make bench-quick): smaller sizes, no peers")
    mode.add_argument("--full", action="store_true", help="everything (make bench), the default")
    ap.add_argument("--only", default="", help=f"comma list of: {','.join(SCENARIOS)}")
    peer = ap.add_mutually_exclusive_group()
    peer.add_argument("--peers", dest="peers", action="store_true", default=None, help="run the peers (even in quick)")
    peer.add_argument("--no-peers", dest="peers", action="store_false", help="skip the peers")
    ap.add_argument("--fsync", action="store_true", help="start our stacks' Postgres with fsync on")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a size of the plan, e.g. --set growth_sizes=100,1000 --set turnaround_runs=20")
    ap.add_argument("--out", default=str(REPO / "docs" / "BENCHMARKS.md"))
    ap.add_argument("--results", default=str(RESULTS), metavar="DIR",
                    help="where the raw results, bench.log and the role logs go (default bench/results)")
    ap.add_argument("--command", default="", help="the command line to record in the report")
    ap.add_argument("--from-results", metavar="JSON", default="",
                    help="measure nothing: rewrite the report (and plots) from a raw results file of an earlier run")
    args = ap.parse_args(argv)
    if args.from_results:
        return rewrite(Path(args.from_results), args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    return Run(args).run()


if __name__ == "__main__":
    sys.exit(main())
