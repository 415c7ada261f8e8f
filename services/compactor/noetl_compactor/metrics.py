"""The compactor's Prometheus metrics (seed 004 section 12)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from noetl_common.shardtasks import forget_on_loss

EVENTS_PER_SECOND = Gauge("noetl_compactor_events_per_second",
                          "Events compacted per second by the shard's last batch", ["shard"])
forget_on_loss("compactor", EVENTS_PER_SECOND)
EXECUTIONS = Counter("noetl_compactor_executions_total", "Executions compacted into manifests", ["shard"])
EVENTS = Counter("noetl_compactor_events_deleted_total", "Events deleted by retention (compaction)", ["shard"])
BARRIERS = Counter("noetl_compactor_barrier_events_deleted_total",
                   "Checkpoint barrier events deleted by retention", ["shard"])
PARTITIONS = Counter("noetl_compactor_partitions_dropped_total", "Expired, empty event partitions dropped")
