"""The compactor role: retention (finished executions older than the horizon become
``noetl.manifest`` / ``noetl.manifest_part``, their events are deleted, expired empty
partitions are dropped) and event partitions created ahead of need."""

import noetl_common  # noqa: F401  (first: gRPC fork support off before gRPC loads)
