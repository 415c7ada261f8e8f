"""Generate the Grafana dashboards shipped by the Helm chart (an overview and one per role).

    python scripts/gen_dashboards.py           # write deploy/helm/noetl/dashboards/*.json
    python scripts/gen_dashboards.py --check   # exit 1 if the committed files are stale

Every expression reads only metrics the runtime exports (grep ``Counter(``/``Gauge(``/
``Histogram(`` under libs/ and services/: the ``noetl_*`` ones and the standard gRPC
server metrics ``grpc_server_*``, noetl_common/grpcmetrics.py) plus Prometheus' own ``up``
and the Python client's ``process_*``. Series carry the target labels ``namespace``, ``pod`` and
``component`` (the role), which the chart's ServiceMonitor sets; the dashboards filter on
``namespace=~"$namespace"``. ``make check-deploy`` runs every expression against a real
Prometheus scraping a local stack and fails on any that returns no data.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "noetl" / "dashboards"
NS = 'namespace=~"$namespace"'
RI = "$__rate_interval"
ROLES = ("api", "shard-manager", "projector", "checkpointer", "compactor", "reaper", "worker")
SHARDED = ("api", "projector", "checkpointer", "compactor", "reaper")
# grpc_code values counted as the server's errors (noetl_common.grpcmetrics.SERVER_ERROR_CODES)
SERVER_ERRORS = "Unknown|DeadlineExceeded|Unimplemented|Internal|Unavailable|DataLoss"
DS = {"type": "prometheus", "uid": "${datasource}"}


def eq(label: str, value: str) -> str:
    return f'{label}="{value}"'


def rx(label: str, value: str) -> str:
    return f'{label}=~"{value}"'


def sel(*matchers: str) -> str:
    return "{" + ",".join((NS, *matchers)) + "}"


def comp(role: str, *matchers: str) -> str:
    return sel(f'component="{role}"', *matchers)


def held(metric: str, role: str) -> str:
    """A per-shard gauge, only on the pod that holds the shard now. A pod drops the series
    of a shard it loses; the join also hides a pod's last scrape until it goes stale."""
    return (f"{metric}{sel()} and on (namespace, instance, shard) "
            f"(noetl_shard_owner{sel(eq('role', role))} == 1)")


def rpc(role: str, method: str) -> str:
    """Calls/s of one gRPC method (by name; ``method`` may be a regular expression)."""
    return f"sum(rate(grpc_server_handled_total{comp(role, rx('grpc_method', method))}[{RI}]))"


def quantile(q: float, metric: str, labels: str, by: str = "") -> str:
    keys = ", ".join(["le", *[b for b in by.split(",") if b.strip()]])
    return f"histogram_quantile({q}, sum by ({keys}) (rate({metric}_bucket{labels}[{RI}])))"


@dataclass
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (expr, legend)
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""
    width: int = 12
    height: int = 8


@dataclass
class Row:
    title: str
    panels: list[Panel] = field(default_factory=list)


def stat(title: str, expr: str, unit: str = "short", description: str = "") -> Panel:
    return Panel(title, [(expr, title)], unit, "stat", description, width=4, height=4)


# ---------------------------------------------------------------- shared rows


def process_row(role: str) -> Row:
    c = comp(role)
    return Row("Pods", [
        stat("Pods up", f"sum(up{c})", description="Scrape targets of this role that answer."),
        stat("Process restarts (1h)", f"sum(changes(process_start_time_seconds{c}[1h]))",
             description="Restarts of the role's processes in their pods during the last hour."),
        stat("Resident memory (max pod)", f"max(process_resident_memory_bytes{c})", "bytes"),
        stat("Open file descriptors (max pod)", f"max(process_open_fds{c})"),
        stat("gRPC calls/s", f"sum(rate(grpc_server_handled_total{c}[{RI}]))", "reqps"),
        stat("Versions running", f"count(count by (version) (noetl_build_info{c}))",
             description="Distinct noetl_build_info versions among the role's pods: 2 during a rollout."),
        stat("Python GC collections/s", f"sum(rate(python_gc_collections_total{c}[{RI}]))"),
        Panel("CPU by pod", [(f"sum by (pod) (rate(process_cpu_seconds_total{c}[{RI}]))", "{{pod}}")], "percentunit",
              description="CPU seconds per second (1 = one core)."),
        Panel("Resident memory by pod", [(f"sum by (pod) (process_resident_memory_bytes{c})", "{{pod}}")], "bytes"),
    ])


def grpc_row(role: str) -> Row:
    c = comp(role)
    return Row("gRPC (server side)", [
        Panel("Calls by method and code", [
            (f"sum by (grpc_method, grpc_code) (rate(grpc_server_handled_total{c}[{RI}]))",
             "{{grpc_method}} {{grpc_code}}")], "reqps",
            description="grpc_server_handled_total: every call answered, health checks included."),
        Panel("Latency p99 by method (unary)", [
            (quantile(0.99, "grpc_server_handling_seconds", comp(role, eq("grpc_type", "unary")), "grpc_method"),
             "{{grpc_method}}")], "s"),
        Panel("Calls in progress by method", [
            (f"sum by (grpc_method) (grpc_server_started_total{c}) - "
             f"sum by (grpc_method) (grpc_server_handled_total{c})", "{{grpc_method}}")],
            description="Started and not yet answered: open WatchExecution streams, slow calls."),
    ])


def lease_row(role: str) -> Row:
    return Row("Shards and leases", [
        Panel("Shards held by pod", [
            (f"sum by (pod) (noetl_shard_owner{comp(role, eq('role', role))})", "{{pod}}")],
            description="noetl_shard_owner: 1 per shard lease the pod holds."),
        Panel("Lease renewal rounds and losses", [
            (f"sum by (pod) (rate(noetl_lease_renewals_total{comp(role)}[{RI}]))", "renewals/s {{pod}}"),
            (f"sum by (pod) (increase(noetl_lease_losses_total{comp(role)}[{RI}]))", "lost {{pod}}")],
            description="Leases are lost when shards are reassigned (scaling, a rollout) or expire "
                        "(a member missed its renewals)."),
    ])


# ---------------------------------------------------------------- dashboards


def overview() -> list[Row]:
    up = sel(rx("component", "|".join(ROLES)))
    errors = (f"(sum by (component) (rate(grpc_server_handled_total{sel(rx('grpc_code', SERVER_ERRORS))}[{RI}])) "
              f"or sum by (component) (rate(grpc_server_handled_total{sel()}[{RI}])) * 0) "
              f"/ sum by (component) (rate(grpc_server_handled_total{sel()}[{RI}]))")
    return [
        Row("Executions", [
            stat("Active executions", f"max(noetl_active_executions{sel()})",
                 description="Running + waiting to start, as admission control last measured it (every api "
                             "replica measures every 5 s, and at most once a second on submissions)."),
            stat("Queued commands", f"max(noetl_queued_commands{sel()})",
                 description="Commands waiting for a worker, as admission control last measured it."),
            stat("Submissions/s", rpc("api", "SubmitExecution"), "reqps"),
            stat("Worker slots busy", f"sum(noetl_worker_busy{sel()}) / sum(noetl_worker_concurrency{sel()})",
                 "percentunit",
                 description="Commands running now / command slots (replicas x NOETL_WORKER_CONCURRENCY), all "
                             "workers; the saturation alert fires above 0.9."),
            stat("Max projection lag", f"max({held('noetl_projection_lag_seconds', 'projector')})", "s"),
            stat("Max checkpoint age", f"max({held('noetl_checkpoint_age_seconds', 'checkpointer')})", "s"),
            Panel("Events appended vs projected", [
                (f"sum(rate(noetl_engine_events_total{sel()}[{RI}]))", "appended (engine)"),
                (f"sum(rate(noetl_projected_events_total{sel()}[{RI}]))", "projected")], "ops"),
            Panel("Commands finished by status", [
                (f"sum by (status) (rate(noetl_worker_commands_total{sel()}[{RI}]))", "{{status}}")], "ops"),
            Panel("Submissions rejected by admission control", [
                (f"sum by (reason) (rate(noetl_submissions_rejected_total{sel()}[{RI}]))", "{{reason}}")], "reqps"),
            Panel("Commands reaped and dead-lettered", [
                (f"sum by (reason) (rate(noetl_reaped_commands_total{sel()}[{RI}]))", "{{reason}}"),
                (f"sum(rate(noetl_engine_dead_letters_total{sel()}[{RI}]))", "dead-lettered")], "ops",
                description="lease_expired: the worker died or froze mid-task (re-issued, or dead-lettered past "
                            "NOETL_COMMAND_MAX_ATTEMPTS); republished: queued too long; dead-lettered: "
                            "command.dead_lettered appended (the step failed)."),
        ]),
        Row("Faults", [
            stat("Pods not ready", f"count(noetl_serving{up} == 0) or vector(0)",
                 description="Pods reporting NOT_SERVING (noetl_serving 0): a dependency unreachable or a shard "
                             "loop crashing again and again (the pod log says which)."),
            stat("Postgres unreachable (pods)", f"count(noetl_dependency_up{sel(eq('dependency', 'postgres'))} == 0)"
                 " or vector(0)", description="Pods whose health check cannot reach Postgres now."),
            stat("Shard loop restarts (1h)", f"sum(increase(noetl_shard_loop_restarts_total{sel()}[1h]))",
                 description="Shard loops started again after an exception escaped them."),
            stat("Quarantined inputs (1h)", f"sum(increase(noetl_engine_quarantined_total{sel()}[1h]))",
                 description="Engine inputs set aside after failing their batch repeatedly (ListQuarantined)."),
            stat("Events stream resets (1h)", f"sum(increase(noetl_engine_stream_resets_total{sel()}[1h]))",
                 description="An engine found NOETL_EVENTS behind its recorded position (messages lost by NATS, or "
                             "the stream recreated) and resumed at its end."),
            stat("Stalled sessions ended (1h)", f"sum(increase(noetl_shard_manager_ended_sessions_total{sel()}[1h]))",
                 description="Postgres sessions of dead members that held a lease row (a frozen member), ended by "
                             "the shard-manager leader."),
            Panel("Readiness and dependencies by role", [
                (f"sum by (component) (noetl_serving{up})", "serving {{component}}"),
                (f"sum by (component) (noetl_dependency_up{sel(eq('dependency', 'postgres'))})",
                 "postgres reachable {{component}}")],
                description="Per role: pods SERVING, and pods whose health check reaches Postgres."),
            Panel("Recovery actions", [
                (f"sum by (role) (rate(noetl_shard_loop_restarts_total{sel()}[{RI}]))", "loop restarts {{role}}"),
                (f"sum(rate(noetl_engine_resubscribes_total{sel()}[{RI}]))", "engine consumers re-created"),
                (f"sum(rate(noetl_worker_results_republished_total{sel()}[{RI}]))", "results republished (worker)"),
                (f"sum(rate(noetl_engine_quarantined_total{sel()}[{RI}]))", "inputs quarantined")], "ops",
                description="What the runtime did to recover: loops restarted, consumers re-created after a NATS "
                            "reconnect, results a restarted stream lost published again, poison inputs set aside."),
        ]),
        Row("Cluster", [
            stat("Shard-manager leader", f"max(noetl_shard_manager_leader{sel()})",
                 description="1 while a shard-manager replica holds the leader lease."),
            stat("Shard moves (1h)", f"sum(increase(noetl_shard_moves_total{sel()}[1h]))"),
            stat("Lease losses (1h)", f"sum(increase(noetl_lease_losses_total{sel()}[1h]))"),
            stat("Pods up", f"sum(up{up})"),
            stat("Commands republished (1h)", f"sum(increase(noetl_engine_republished_commands_total{sel()}[1h]))"),
            stat("Dead letters (1h)", f"sum(increase(noetl_dead_letters_total{sel()}[1h]))",
                 description="Commands that exhausted their attempts (a task that still failed after its policy's "
                             "retries, or claims expired NOETL_COMMAND_MAX_ATTEMPTS times): `noetl-rt dlq list`."),
            stat("Events compacted/s", f"sum(rate(noetl_compactor_events_deleted_total{sel()}[{RI}])) + "
                 f"sum(rate(noetl_compactor_barrier_events_deleted_total{sel()}[{RI}]))", "ops"),
            Panel("Pods up by role", [(f"sum by (component) (up{up})", "{{component}}")]),
            Panel("Pods by role and version", [
                (f"count by (component, version) (noetl_build_info{up})", "{{component}} {{version}}")],
                description="noetl_build_info: the runtime version each pod runs (two during a rollout)."),
            Panel("Shards owned by role", [(f"sum by (role) (noetl_shard_owner{sel()})", "{{role}}")],
                  description="Should equal NOETL_SHARD_COUNT for every sharded role."),
            Panel("gRPC server-error ratio by role", [(errors, "{{component}}")], "percentunit"),
            Panel("CPU by role", [
                (f"sum by (component) (rate(process_cpu_seconds_total{up}[{RI}]))", "{{component}}")],
                "percentunit"),
        ]),
    ]


def api() -> list[Row]:
    c = comp("api")
    return [
        Row("Admission and submissions", [
            stat("Active executions", f"max(noetl_active_executions{c})"),
            stat("Queued commands", f"max(noetl_queued_commands{c})"),
            stat("Submissions/s", rpc("api", "SubmitExecution"), "reqps"),
            stat("Rejected (1h)", f"sum(increase(noetl_submissions_rejected_total{c}[1h]))"),
            stat("Claims/s", rpc("api", "ClaimCommands?"), "reqps"),
            stat("Commands republished (1h)", f"sum(increase(noetl_engine_republished_commands_total{c}[1h]))"),
            Panel("Active executions and queued commands", [
                (f"max(noetl_active_executions{c})", "active executions"),
                (f"max(noetl_queued_commands{c})", "queued commands")],
                description="Measured by admission control: every 5 s per replica, and at most once a second on "
                            "submissions."),
            Panel("Rejections by reason", [
                (f"sum by (reason) (rate(noetl_submissions_rejected_total{c}[{RI}]))", "{{reason}}")], "reqps"),
        ]),
        Row("Engine", [
            Panel("Events appended by shard", [
                (f"sum by (shard) (rate(noetl_engine_events_total{c}[{RI}]))", "shard {{shard}}")], "ops"),
            Panel("Batch transaction time", [
                (quantile(0.5, "noetl_engine_batch_seconds", c), "p50"),
                (quantile(0.99, "noetl_engine_batch_seconds", c), "p99")], "s"),
            Panel("Inputs per batch", [
                (quantile(0.5, "noetl_engine_batch_inputs", c), "p50"),
                (quantile(0.99, "noetl_engine_batch_inputs", c), "p99")]),
            Panel("Batches by commit path", [
                (f"sum by (path) (rate(noetl_engine_batches_total{c}[{RI}]))", "{{path}}")], "ops",
                description="one statement: the usual worker result, committed as one autocommit statement; "
                            "needs reads / dependent writes: the transaction; gate missed: a fence lost or a "
                            "duplicate start nudge (often worth a look)."),
            Panel("Commands handed straight to workers", [
                (f"sum by (shard) (rate(noetl_engine_handoffs_total{c}[{RI}]))", "shard {{shard}}")], "ops",
                description="Next commands sent to the worker whose result led to them, skipping the claim "
                            "(noetl_worker_claims_total{outcome=\"handoff\"} on the worker side)."),
            Panel("Inputs replayed after takeovers", [
                (f"sum by (shard) (increase(noetl_engine_replayed_inputs_total{c}[{RI}]))", "shard {{shard}}")],
                description="Inputs delivered to a previous owner of the shard but not committed by it."),
            Panel("Dead letters by shard", [
                (f"sum by (shard) (increase(noetl_engine_dead_letters_total{c}[{RI}]))", "shard {{shard}}")],
                description="command.dead_lettered appended: a command's claim expired NOETL_COMMAND_MAX_ATTEMPTS "
                            "times; its step failed."),
            Panel("Dead letters and redrives", [
                (f"sum by (reason) (increase(noetl_dead_letters_total{c}[{RI}]))", "dead letter: {{reason}}"),
                (f"sum by (outcome) (increase(noetl_dead_letter_redrives_total{c}[{RI}]))", "redrive: {{outcome}}")],
                description="Commands recorded in noetl.dead_letter (failed: a call.error accepted after the task's "
                            "retries; expired: claim leases ran out) and redrive requests the engine applied "
                            "(redriven, or refused: `noetl-rt dlq show ID` says why)."),
            Panel("Reruns", [
                (f"sum by (outcome) (increase(noetl_reruns_total{c}[{RI}]))", "{{outcome}}")],
                description="RerunExecution (`noetl-rt rerun`): new executions that rerun a finished one from its "
                            "failed (or a named) step; deduplicated: a retried call answered with its rerun."),
            Panel("Executions queued by concurrency limits", [
                (f"sum by (shard) (increase(noetl_engine_concurrency_queued_total{c}[{RI}]))", "shard {{shard}}")],
                description="Executions that were to start but waited for a slot of a concurrency limit "
                            "(`noetl-rt limit list` shows what runs and waits per key)."),
            Panel("Quarantined inputs and stream resets by shard", [
                (f"sum by (shard) (increase(noetl_engine_quarantined_total{c}[{RI}]))", "quarantined {{shard}}"),
                (f"sum by (shard) (increase(noetl_engine_stream_resets_total{c}[{RI}]))", "stream reset {{shard}}"),
                (f"sum by (shard) (increase(noetl_engine_resubscribes_total{c}[{RI}]))", "resubscribed {{shard}}")],
                description="Poison inputs set aside (ListQuarantined), the events stream found behind the recorded "
                            "position, consumers re-created after NATS reconnects."),
        ]),
        Row("Result store (reads by the engine and GetExecution)", [
            Panel("Reference resolve time p99 by tier", [
                (quantile(0.99, "noetl_reference_resolve_seconds", c, "tier"), "{{tier}}")], "s"),
            Panel("Read-through cache lookups", [
                (f"sum by (cache, outcome) (rate(noetl_result_cache_requests_total{c}[{RI}]))", "{{cache}} {{outcome}}")],
                "ops", description="Only with NOETL_RESULT_CACHE=kv."),
        ]),
        lease_row("api"), grpc_row("api"), process_row("api"),
    ]


def shard_manager() -> list[Row]:
    c = comp("shard-manager")
    return [
        Row("Leadership and assignment", [
            stat("Leader", f"max(noetl_shard_manager_leader{c})"),
            stat("Shard moves (1h)", f"sum(increase(noetl_shard_moves_total{c}[1h]))"),
            stat("Members joining/s", rpc("shard-manager", "Join"), "reqps"),
            stat("Heartbeats/s", rpc("shard-manager", "Heartbeat"), "reqps"),
            Panel("Leader by pod", [(f"max by (pod) (noetl_shard_manager_leader{c})", "{{pod}}")]),
            Panel("Shard moves", [(f"sum(increase(noetl_shard_moves_total{c}[{RI}]))", "moves")],
                  description="Ownership changes made by the leader (rebalances, dead members)."),
            Panel("Shards owned by role", [(f"sum by (role) (noetl_shard_owner{sel()})", "{{role}}")]),
            Panel("Shards held by pod", [(f"sum by (role, pod) (noetl_shard_owner{sel()})", "{{role}} {{pod}}")]),
        ]),
        grpc_row("shard-manager"), process_row("shard-manager"),
    ]


def projector() -> list[Row]:
    c = comp("projector")
    return [
        Row("Projection", [
            stat("Max lag", f"max({held('noetl_projection_lag_seconds', 'projector')})", "s"),
            stat("Projected events/s", f"sum(rate(noetl_projected_events_total{c}[{RI}]))", "ops"),
            stat("Appended events/s (engine)", f"sum(rate(noetl_engine_events_total{sel()}[{RI}]))", "ops"),
            Panel("Lag by shard (held shards)", [
                (f"max by (shard) ({held('noetl_projection_lag_seconds', 'projector')})", "shard {{shard}}")], "s",
                description="Age of the newest projected event when it was projected; the alert fires above 1 s "
                            "sustained while the shard is being projected."),
            Panel("Projected events by shard", [
                (f"sum by (shard) (rate(noetl_projected_events_total{c}[{RI}]))", "shard {{shard}}")], "ops"),
            Panel("Appended vs projected", [
                (f"sum(rate(noetl_engine_events_total{sel()}[{RI}]))", "appended"),
                (f"sum(rate(noetl_projected_events_total{c}[{RI}]))", "projected")], "ops"),
        ]),
        lease_row("projector"), grpc_row("projector"), process_row("projector"),
    ]


def checkpointer() -> list[Row]:
    c = comp("checkpointer")
    return [
        Row("Checkpoints", [
            stat("Max checkpoint age", f"max({held('noetl_checkpoint_age_seconds', 'checkpointer')})", "s"),
            stat("Sealed/s", f"sum(rate(noetl_checkpoints_sealed_total{c}[{RI}]))", "ops"),
            stat("Barriers requested/s", f"sum(rate(noetl_checkpoint_barriers_requested_total{c}[{RI}]))", "ops"),
            Panel("Checkpoint age by shard (held shards)", [
                (f"max by (shard) ({held('noetl_checkpoint_age_seconds', 'checkpointer')})", "shard {{shard}}")], "s",
                description="Age of the shard's oldest event not yet covered by a sealed checkpoint (0 when "
                            "everything is sealed; about one checkpoint interval plus the projection lag when healthy)."),
            Panel("Epochs sealed by shard", [
                (f"sum by (shard) (rate(noetl_checkpoints_sealed_total{c}[{RI}]))", "shard {{shard}}")], "ops"),
            Panel("Barriers requested by shard", [
                (f"sum by (shard) (rate(noetl_checkpoint_barriers_requested_total{c}[{RI}]))", "shard {{shard}}")],
                "ops"),
        ]),
        lease_row("checkpointer"), grpc_row("checkpointer"), process_row("checkpointer"),
    ]


def compactor() -> list[Row]:
    c = comp("compactor")
    return [
        Row("Retention", [
            stat("Events compacted/s", f"sum(rate(noetl_compactor_events_deleted_total{c}[{RI}])) + "
                 f"sum(rate(noetl_compactor_barrier_events_deleted_total{c}[{RI}]))", "ops"),
            stat("Executions compacted (1h)", f"sum(increase(noetl_compactor_executions_total{c}[1h]))"),
            stat("Events deleted (1h)", f"sum(increase(noetl_compactor_events_deleted_total{c}[1h]))"),
            stat("Partitions dropped (24h)", f"sum(increase(noetl_compactor_partitions_dropped_total{c}[24h]))"),
            Panel("Compaction throughput by shard", [
                (f"sum by (shard) (rate(noetl_compactor_events_deleted_total{c}[{RI}])) + "
                 f"sum by (shard) (rate(noetl_compactor_barrier_events_deleted_total{c}[{RI}]))", "shard {{shard}}")],
                "ops", description="Events (and checkpoint barriers) compacted per second, by shard "
                                   "(NOETL_COMPACTOR_ENABLED)."),
            Panel("Time in compaction batches by shard", [
                (f"sum by (shard) (rate(noetl_compactor_batch_seconds_total{c}[{RI}]))", "shard {{shard}}")],
                "percentunit",
                description="Share of the time each shard's compactor spends in batches. Events compacted per "
                            "second of work: the throughput above divided by this."),
            Panel("Executions compacted into manifests", [
                (f"sum by (shard) (rate(noetl_compactor_executions_total{c}[{RI}]))", "shard {{shard}}")], "ops"),
            Panel("Events deleted", [
                (f"sum(rate(noetl_compactor_events_deleted_total{c}[{RI}]))", "events"),
                (f"sum(rate(noetl_compactor_barrier_events_deleted_total{c}[{RI}]))", "checkpoint barriers")], "ops"),
        ]),
        lease_row("compactor"), grpc_row("compactor"), process_row("compactor"),
    ]


def reaper() -> list[Row]:
    c = comp("reaper")
    return [
        Row("Reaping", [
            stat("Claims expired (1h)", f"sum(increase(noetl_reaped_commands_total{comp('reaper', eq('reason', 'lease_expired'))}[1h]))",
                 description="Commands whose worker stopped renewing the claim; re-issued or dead-lettered."),
            stat("Republished (1h)", f"sum(increase(noetl_reaped_commands_total{comp('reaper', eq('reason', 'republished'))}[1h]))"),
            Panel("Commands reaped by reason", [
                (f"sum by (reason) (rate(noetl_reaped_commands_total{c}[{RI}]))", "{{reason}}")], "ops"),
            stat("Unschedulable commands", f"sum(noetl_commands_unschedulable{c})",
                 description="Queued commands no live worker qualifies for (their pool has no live worker, or none"
                             " with their labels); docs/ARCHITECTURE.md \"Worker pools and priorities\"."),
            Panel("Unschedulable commands by pool", [
                (f"sum by (pool) (noetl_commands_unschedulable{c})", "{{pool}}")], "short",
                description="Per pool, queued commands no live worker can take: start a worker in that pool."),
        ]),
        Row("Schedules", [
            stat("Ticks fired (1h)", f"sum(increase(noetl_schedule_fired_total{c}[1h]))",
                 description="Schedule ticks fired, each once (docs/ARCHITECTURE.md \"Schedules\")."),
            stat("Ticks skipped (1h)", f"sum(increase(noetl_schedule_skipped_total{c}[1h]))",
                 description="Due ticks dropped by their catch-up policy (skip, once) after an outage."),
            stat("Submissions refused (1h)",
                 f"sum(increase(noetl_schedule_submitted_total{comp('reaper', eq('outcome', 'refused'))}[1h]))",
                 description="Ticks the api refused for good (e.g. the playbook left the catalog)."),
            Panel("Schedule ticks", [
                (f"sum(rate(noetl_schedule_fired_total{c}[{RI}]))", "fired"),
                (f"sum(rate(noetl_schedule_skipped_total{c}[{RI}]))", "skipped"),
                (f"sum by (outcome) (rate(noetl_schedule_submitted_total{c}[{RI}]))", "submitted: {{outcome}}")],
                "ops"),
            Panel("Schedule lag (tick to submission)", [
                (quantile(0.5, "noetl_schedule_lag_seconds", c), "p50"),
                (quantile(0.99, "noetl_schedule_lag_seconds", c), "p99")], "s",
                description="From a tick's time to its execution's submission: the poll, a failover, the api."),
        ]),
        lease_row("reaper"), grpc_row("reaper"), process_row("reaper"),
    ]


def worker() -> list[Row]:
    c = comp("worker")
    return [
        Row("Commands", [
            stat("Busy slots", f"sum(noetl_worker_busy{c})",
                 description="Commands running now, all workers."),
            stat("Slots", f"sum(noetl_worker_concurrency{c})",
                 description="Command slots: replicas x NOETL_WORKER_CONCURRENCY."),
            stat("Commands/s", f"sum(rate(noetl_worker_commands_total{c}[{RI}]))", "ops"),
            stat("Claims/s", f"sum(rate(noetl_worker_claims_total{c}[{RI}]))", "ops"),
            stat("Cancel hints (1h)", f"sum(increase(noetl_worker_cancel_hints_total{c}[1h]))"),
            stat("Saturation", f"sum(noetl_worker_busy{c}) / sum(noetl_worker_concurrency{c})", "percentunit",
                 description="Busy slots / slots; the saturation alert fires above 0.9 sustained."),
            Panel("Busy slots by pod", [
                (f"sum by (pod) (noetl_worker_busy{c})", "busy {{pod}}"),
                (f"sum by (pod) (noetl_worker_concurrency{c})", "slots {{pod}}")]),
            Panel("Commands finished by kind and status", [
                (f"sum by (kind, status) (rate(noetl_worker_commands_total{c}[{RI}]))", "{{kind}} {{status}}")], "ops"),
            Panel("Task duration by kind", [
                (quantile(0.5, "noetl_worker_task_seconds", c, "kind"), "p50 {{kind}}"),
                (quantile(0.99, "noetl_worker_task_seconds", c, "kind"), "p99 {{kind}}")], "s"),
            Panel("Claims by outcome", [
                (f"sum by (outcome) (rate(noetl_worker_claims_total{c}[{RI}]))", "{{outcome}}")], "ops"),
        ]),
        Row("Results", [
            Panel("Result envelope size", [
                (quantile(0.5, "noetl_event_result_bytes", c), "p50"),
                (quantile(0.99, "noetl_event_result_bytes", c), "p99")], "bytes"),
            Panel("Result store writes by tier and outcome", [
                (f"sum by (tier, outcome) (rate(noetl_result_store_writes_total{c}[{RI}]))", "{{tier}} {{outcome}}")],
                "ops"),
            Panel("Reference resolve time p99 by tier", [
                (quantile(0.99, "noetl_reference_resolve_seconds", c, "tier"), "{{tier}}")], "s"),
            Panel("Read-through cache lookups", [
                (f"sum by (cache, outcome) (rate(noetl_result_cache_requests_total{c}[{RI}]))", "{{cache}} {{outcome}}")],
                "ops", description="Only with NOETL_RESULT_CACHE=kv."),
        ]),
        grpc_row("worker"), process_row("worker"),
    ]


DASHBOARDS = {
    "noetl-overview": ("NoETL / Overview", overview),
    "noetl-api": ("NoETL / api (client API + engine)", api),
    "noetl-shard-manager": ("NoETL / shard-manager", shard_manager),
    "noetl-projector": ("NoETL / projector", projector),
    "noetl-checkpointer": ("NoETL / checkpointer", checkpointer),
    "noetl-compactor": ("NoETL / compactor", compactor),
    "noetl-reaper": ("NoETL / reaper", reaper),
    "noetl-worker": ("NoETL / worker", worker),
}


# ---------------------------------------------------------------- Grafana JSON


def panel_json(p: Panel, pid: int, x: int, y: int) -> dict[str, object]:
    out: dict[str, object] = {
        "id": pid, "type": p.kind, "title": p.title, "datasource": DS,
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend,
                     "range": True, "instant": False}
                    for i, (expr, legend) in enumerate(p.targets)],
    }
    if p.description:
        out["description"] = p.description
    if p.kind == "stat":
        out["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                          "colorMode": "value", "graphMode": "area", "textMode": "auto", "justifyMode": "auto"}
    else:
        out["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                          "tooltip": {"mode": "multi", "sort": "desc"}}
        out["fieldConfig"] = {"defaults": {"unit": p.unit, "custom": {"fillOpacity": 10, "showPoints": "never"}},
                              "overrides": []}
    return out


def dashboard_json(uid: str, title: str, rows: list[Row]) -> dict[str, object]:
    panels: list[dict[str, object]] = []
    pid, y = 1, 0
    for row in rows:
        panels.append({"id": pid, "type": "row", "title": row.title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y, x, line = pid + 1, y + 1, 0, 0
        for p in row.panels:
            if x + p.width > 24:
                x, y = 0, y + line
                line = 0
            panels.append(panel_json(p, pid, x, y))
            pid, x, line = pid + 1, x + p.width, max(line, p.height)
        y += line
    return {
        "uid": uid, "title": title, "tags": ["noetl"], "editable": True, "graphTooltip": 1,
        "schemaVersion": 39, "version": 1, "refresh": "30s", "timezone": "browser",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "tags": ["noetl"], "asDropdown": True, "title": "NoETL",
                   "includeVars": True, "keepTime": True}],
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "options": []},
            {"name": "namespace", "label": "Namespace", "type": "query", "datasource": DS,
             "query": {"query": "label_values(noetl_build_info, namespace)", "refId": "namespace"},
             "definition": "label_values(noetl_build_info, namespace)",
             "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2, "sort": 1, "hide": 0,
             "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": []},
        ]},
        "panels": panels,
    }


def render() -> dict[str, str]:
    return {f"{uid}.json": json.dumps(dashboard_json(uid, title, build()), indent=2) + "\n"
            for uid, (title, build) in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed dashboards are stale")
    args = ap.parse_args(argv)
    files = render()
    if args.check:
        stale = [n for n, text in files.items() if not (OUT / n).exists() or (OUT / n).read_text() != text]
        extra = sorted(p.name for p in OUT.glob("*.json") if p.name not in files)
        if stale or extra:
            print(f"dashboards stale: {stale} extra: {extra}; run python scripts/gen_dashboards.py", file=sys.stderr)
            return 1
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (OUT / name).write_text(text)
    for p in OUT.glob("*.json"):
        if p.name not in files:
            p.unlink()
    print(f"wrote {len(files)} dashboards to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
