"""The shard-manager role: membership, leader election, shard assignment with epochs."""

import noetl_common  # noqa: F401  (first: gRPC fork support off before gRPC loads)
