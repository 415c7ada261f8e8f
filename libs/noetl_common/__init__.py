"""Shared plumbing of every role: ids, configuration, errors, Postgres, NATS, gRPC,
the service skeleton, shard leases, tracing.

Importing this package turns gRPC's fork support off (unless the environment says
otherwise) before gRPC initialises: grpcio >= 1.81 restarts its poller in a child
between fork and exec, where the child's fds are being closed, and the child can die
with ``epoll_wait: Bad file descriptor`` before it execs (grpc/grpc#43055). No process
of this runtime forks to keep using gRPC; every child (Postgres, NATS, the roles, the
worker's python pool) execs at once. The role packages and ``noetl_cli`` import this
package first for that reason.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
