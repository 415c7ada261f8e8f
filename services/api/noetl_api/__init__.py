"""The api role: client gRPC API (executions, catalog, credentials), the WorkerService
claim endpoint, and the engine for the shards this replica holds."""

import noetl_common  # noqa: F401  (first: gRPC fork support off before gRPC loads)
