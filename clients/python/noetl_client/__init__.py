"""The Python client of the NoETL runtime's gRPC API (docs/CLIENTS.md).

    from noetl_client import Client, status_name

    with Client.from_env() as client:          # NOETL_API, NOETL_TOKEN, NOETL_TLS_CA_FILE
        sub = client.submit(open("hello.yaml").read(), payload={"name": "world"})
        for snapshot in client.watch(sub.execution_id):
            print(status_name(snapshot.status))
        print(client.result(sub.execution_id))

Modules: ``values`` (JSON <-> Struct/Value, the number rules), ``executions`` (statuses,
results, requests), ``errors``, ``channel`` (TLS, token, options), ``retries``. The
generated stubs are ``noetl_proto.v1``.
"""

from . import channel, errors, executions, retries, values
from ._client import Client, ClientConfig
from .errors import (
    ApiError,
    ClientError,
    ConfigError,
    Conflict,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    WaitTimeout,
)
from .executions import TERMINAL, is_terminal, results, status_name, step_result, submit_request
from .values import MAX_DEPTH, MAX_EXACT_INT, from_struct, from_value, to_struct, to_value

__all__ = [
    "MAX_DEPTH",
    "MAX_EXACT_INT",
    "TERMINAL",
    "ApiError",
    "Client",
    "ClientConfig",
    "ClientError",
    "ConfigError",
    "Conflict",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "Unauthenticated",
    "Unavailable",
    "WaitTimeout",
    "channel",
    "errors",
    "executions",
    "from_struct",
    "from_value",
    "is_terminal",
    "results",
    "retries",
    "status_name",
    "step_result",
    "submit_request",
    "to_struct",
    "to_value",
    "values",
]
