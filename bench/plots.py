"""Plots for docs/BENCHMARKS.md, rendered in bench/.venv-plot (matplotlib is not a
dependency of the project): ``python bench/plots.py RESULTS.json OUTDIR``. Prints the
path of each PNG written.

* turnaround_latency.png: the step-turnaround latency distribution (ECDF) of this
  runtime (and with fsync on, when measured) beside the peers';
* growth.png: cost versus work size: wall time, events written and each role's peak
  RSS against the loop's item count (log-log; a dashed line of slope 1 for reference);
* fanout.png: 1,000-item fan-out iterations/s per width, this runtime and the peers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

OURS = "noetl-runtime"


def _ok(d: Any) -> bool:
    return isinstance(d, dict) and bool(d.get("ok"))


def turnaround(res: dict[str, Any], out: Path) -> Path | None:
    series: list[tuple[str, list[float]]] = []
    sc = res.get("scenarios", {})
    if _ok(sc.get("turnaround")):
        series.append((f"{OURS} (Postgres fsync off)", sc["turnaround"]["latencies_ms"]))
    durable = sc.get("durable", {}).get("turnaround")
    if _ok(durable):
        series.append((f"{OURS} (Postgres fsync on)", durable["latencies_ms"]))
    for name, peer in res.get("peers", {}).items():
        if isinstance(peer, dict) and peer.get("turnaround", {}).get("latencies_ms"):
            series.append((name.capitalize(), peer["turnaround"]["latencies_ms"]))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, xs in series:
        xs = sorted(xs)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"{label}: p50 {xs[len(xs) // 2]:.0f} ms")
    ax.set_xscale("log")
    ax.set_xlabel("submit -> completed, as the client sees it (ms, log scale)")
    ax.set_ylabel("share of runs")
    ax.set_title("Step turnaround: 3-step playbook / workflow / flow, one at a time")
    ax.axvline(50, color="grey", linestyle=":", linewidth=1)
    ax.text(50, 0.02, " 50 ms target", color="grey", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    path = out / "turnaround_latency.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def growth(res: dict[str, Any], out: Path) -> Path | None:
    g = res.get("scenarios", {}).get("growth")
    if not _ok(g):
        return None
    pts = sorted((p for p in g["points"] if "error" not in p), key=lambda p: p["items"])
    if len(pts) < 2:
        return None
    items = [p["items"] for p in pts]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    ax = axes[0]
    walls = [p["wall_s"] for p in pts]
    ax.plot(items, walls, "o-", label="wall time (s)")
    ref = [walls[0] * i / items[0] for i in items]
    ax.plot(items, ref, "--", color="grey", linewidth=1, label="linear from the first point")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("loop items")
    ax.set_ylabel("seconds")
    ax.set_title("Wall time (submit -> completed)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax = axes[1]
    ax.plot(items, [p["events"] for p in pts], "o-", label="events written (noetl.event)")
    ax.plot(items, [p["meter"]["write_txns"] for p in pts], "s-", label="Postgres write transactions")
    js = [sum(p["meter"]["js_messages"].values()) for p in pts]
    ax.plot(items, js, "^-", label="JetStream messages")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("loop items")
    ax.set_title("Work written")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax = axes[2]
    roles = [r for r in pts[-1]["meter"]["usage"]["trees"] if r not in ("bench-client",)]
    for role in roles:
        ys = [p["meter"]["usage"]["trees"].get(role, {}).get("peak_rss_mib", float("nan")) for p in pts]
        ax.plot(items, ys, "o-", label=f"{role} (PSS: shared buffers once)" if role == "postgres" else role)
    ax.set_xscale("log")
    ax.set_xlabel("loop items")
    ax.set_ylabel("peak RSS (MiB, process + children)")
    ax.set_title("Peak memory per process during the run")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"Growth: parallel loop of trivial python tasks, max_in_flight {pts[0]['max_in_flight']}")
    fig.tight_layout()
    path = out / "growth.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fanout(res: dict[str, Any], out: Path) -> Path | None:
    f = res.get("scenarios", {}).get("fanout")
    bars: dict[str, dict[int, float]] = {}
    if _ok(f):
        bars[OURS] = {r["max_in_flight"]: r["iterations_per_s"] for r in f["runs"] if "error" not in r}
    for name, peer in res.get("peers", {}).items():
        if isinstance(peer, dict) and peer.get("fanout"):
            bars[name.capitalize()] = {int(w): r["iterations_per_s"] for w, r in peer["fanout"].items()}
    if not bars:
        return None
    widths = sorted({w for b in bars.values() for w in b})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    step = 0.8 / len(bars)
    for k, (label, vals) in enumerate(bars.items()):
        xs = [i + k * step for i in range(len(widths))]
        ys = [vals.get(w, 0.0) for w in widths]
        ax.bar(xs, ys, width=step, label=label)
        for x, y in zip(xs, ys, strict=True):
            if y:
                ax.text(x, y, f"{y:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks([i + 0.4 - step / 2 for i in range(len(widths))])
    ax.set_xticklabels([f"in flight {w}" for w in widths])
    ax.set_ylabel("iterations / s")
    ax.set_title("1,000-item fan-out of trivial python tasks")
    ax.axhline(1000, color="grey", linestyle=":", linewidth=1)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path = out / "fanout.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    res = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for fn in (turnaround, growth, fanout):
        path = fn(res, out)
        if path is not None:
            print(path)


if __name__ == "__main__":
    main()
