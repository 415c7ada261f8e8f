"""Every metric the runtime exports follows the Prometheus conventions (docs/DEPLOY.md
"Metrics the runtime exports").

The list is found, not written down: every module of the runtime's packages (libs/ and
every role under services/) is imported, and prometheus_client's registry is walked; the
sources are scanned for metric definitions too, and both must agree, so a metric defined
later, anywhere, is checked without editing this file.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

REPO = Path(__file__).resolve().parents[2]
ROOTS = [REPO / "libs", *sorted(p for p in (REPO / "services").iterdir() if p.is_dir())]
_DEFINED = re.compile(r"""\b(Counter|Gauge|Histogram|Summary|Info|Enum)\s*[(,]\s*["']([a-zA-Z_:][a-zA-Z0-9_:]*)["']""")

# Standard names kept as their ecosystems spell them: the gRPC server metrics of
# go-grpc-prometheus (noetl_common.grpcmetrics) and the Python client's own collectors.
STANDARD_PREFIXES = ("grpc_server_", "process_", "python_")
BASE_UNITS = ("seconds", "bytes")
# Histograms of counts: the unit is the thing counted, in the plural.
COUNT_UNITS = ("inputs",)
NOT_BASE_UNITS = {"ms", "millis", "milliseconds", "us", "micros", "microseconds", "ns", "nanoseconds", "minutes",
                  "hours", "days", "kb", "mb", "gb", "kib", "mib", "gib", "kilobytes", "megabytes", "percent"}
PRECOMPUTED_RATE = re.compile(r"_per_(second|sec|minute|min|hour)(_|$)|_(rate|ratio_per_second)$")
TIME_WORDS = {"lag", "age", "duration", "latency", "delay", "elapsed", "time"}
LABEL = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
# Labels that Prometheus sets on every scraped series: a metric's own label of that name
# is renamed exported_<name> when scraped. Existing ones, with why they stay for now.
TARGET_LABELS = {"job", "instance"}
TARGET_LABEL_EXCEPTIONS = {
    ("noetl_shard_owner", "instance"): "the member's NOETL_INSTANCE; dashboards and alerts read it as exported_instance",
    ("noetl_shard_manager_leader", "instance"): "as noetl_shard_owner",
}


def _modules() -> Iterator[str]:
    for root in ROOTS:
        for info in pkgutil.iter_modules([str(root)]):
            if not info.name.startswith("noetl_") or info.name == "noetl_proto":  # generated protobuf code
                continue
            yield info.name
            pkg = importlib.import_module(info.name)
            for mod in pkgutil.walk_packages(pkg.__path__, info.name + "."):
                if not mod.name.endswith(".__main__"):  # runs the program
                    yield mod.name


def _declared() -> dict[str, tuple[str, str]]:
    """Every metric defined in the sources: exported family name -> (kind, file)."""
    out: dict[str, tuple[str, str]] = {}
    for root in ROOTS:
        for path in root.rglob("*.py"):
            if "noetl_proto" in path.parts:
                continue
            for kind, name in _DEFINED.findall(path.read_text()):
                out[name] = (kind, str(path.relative_to(REPO)))
    return out


@pytest.fixture(scope="module")
def families() -> dict[str, dict[str, Any]]:
    """Every metric family in the registry once every runtime module is imported:
    name -> {type, help, labels}."""
    for name in _modules():
        importlib.import_module(name)
    out: dict[str, dict[str, Any]] = {}
    for collector in list(REGISTRY._collector_to_names):
        labels = tuple(getattr(collector, "_labelnames", ()))
        for fam in collector.describe() if isinstance(collector, MetricWrapperBase) else collector.collect():
            out[fam.name] = {"type": fam.type, "help": fam.documentation, "labels": labels,
                             "ours": isinstance(collector, MetricWrapperBase)}
    return out


def _exported(name: str, kind: str) -> str:
    """The family name prometheus_client registers for a declared name."""
    if kind == "Counter" and name.endswith("_total"):
        return name[: -len("_total")]
    if kind == "Info" and name.endswith("_info"):
        return name[: -len("_info")]
    return name


def test_the_sources_and_the_registry_list_the_same_metrics(families: dict[str, dict[str, Any]]) -> None:
    declared = {_exported(n, kind): (kind, where) for n, (kind, where) in _declared().items()}
    assert len(declared) > 50, declared
    missing = {n: w for n, (_, w) in declared.items() if n not in families}
    assert not missing, f"defined in the sources but not registered on import (define metrics at module level): {missing}"
    undeclared = sorted(n for n, f in families.items() if f["ours"] and n not in declared)
    assert not undeclared, f"registered but not found by the source scan (name them with a string literal): {undeclared}"


def test_names_are_prefixed_and_in_base_units(families: dict[str, dict[str, Any]]) -> None:
    bad = {}
    for name, fam in families.items():
        words = set(name.split("_"))
        if not (name.startswith("noetl_") or name.startswith(STANDARD_PREFIXES)):
            bad[name] = "neither noetl_ nor a standard prefix"
        elif words & NOT_BASE_UNITS:
            bad[name] = f"not in base units: {sorted(words & NOT_BASE_UNITS)} (seconds, bytes)"
        elif PRECOMPUTED_RATE.search(name):
            bad[name] = "a precomputed rate: export a counter and let rate() divide"
        elif name.endswith(("_count", "_sum", "_bucket", "_created")):
            bad[name] = "ends like a histogram's own series"
        elif fam["type"] == "gauge" and name.endswith("_total"):
            bad[name] = "a gauge named like a counter"
        elif fam["type"] in ("histogram", "summary") and not name.endswith((*BASE_UNITS, *COUNT_UNITS)):
            bad[name] = f"a {fam['type']} without its unit ({', '.join(BASE_UNITS + COUNT_UNITS)})"
        elif fam["type"] == "gauge" and words & TIME_WORDS and not name.endswith("_seconds"):
            bad[name] = "a time without _seconds"
    assert not bad, bad


def test_counters_are_declared_with_total(families: dict[str, dict[str, Any]]) -> None:
    declared = _declared()
    assert not [n for n, (kind, _) in declared.items() if kind == "Counter" and not n.endswith("_total")]
    counters = [n for n, f in families.items() if f["type"] == "counter" and f["ours"]]
    assert counters and all(f"{n}_total" in declared for n in counters), counters


def test_help_text_and_label_names(families: dict[str, dict[str, Any]]) -> None:
    for name, fam in families.items():
        assert len(fam["help"].strip()) >= 10 and fam["help"] != name, (name, fam["help"])
        for label in fam["labels"]:
            assert LABEL.match(label), (name, label)
            assert label not in ("le", "quantile"), (name, label)
            if label in TARGET_LABELS:
                assert (name, label) in TARGET_LABEL_EXCEPTIONS, (name, label)


def test_build_info_and_no_created_series(families: dict[str, dict[str, Any]]) -> None:
    from noetl_common import metrics

    assert families["noetl_build_info"]["labels"] == ("version", "role", "python_version")
    registry = CollectorRegistry()
    Counter("conventions_probe_total", "A counter only this test sees", registry=registry).inc()
    Histogram("conventions_probe_seconds", "A histogram only this test sees", registry=registry).observe(1)
    metrics.expose("api")
    text = generate_latest(registry).decode() + generate_latest(REGISTRY).decode()
    assert "conventions_probe_total 1.0" in text and "conventions_probe_seconds_count 1.0" in text
    assert "_created" not in text
    info = [ln for ln in text.splitlines() if ln.startswith("noetl_build_info{")]
    assert len(info) == 1 and 'role="api"' in info[0] and info[0].endswith(" 1.0"), info
