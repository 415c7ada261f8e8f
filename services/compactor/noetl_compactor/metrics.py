"""The compactor's Prometheus metrics (seed 004 section 12)."""

from __future__ import annotations

from prometheus_client import Counter

EXECUTIONS = Counter("noetl_compactor_executions_total", "Executions compacted into manifests", ["shard"])
EVENTS = Counter("noetl_compactor_events_deleted_total", "Events deleted by retention (compaction)", ["shard"])
BARRIERS = Counter("noetl_compactor_barrier_events_deleted_total",
                   "Checkpoint barrier events deleted by retention", ["shard"])
# Events compacted per second of work: rate(events + barrier events deleted) / rate(this).
BATCH_SECONDS = Counter("noetl_compactor_batch_seconds_total",
                        "Time spent in compaction batches that compacted something", ["shard"])
PARTITIONS = Counter("noetl_compactor_partitions_dropped_total", "Expired, empty event partitions dropped")
