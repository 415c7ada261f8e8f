"""The checkpointer role: 1 s epoch barriers per shard, sealed in noetl.checkpoint once
both the engine and the projection have passed them."""

import noetl_common  # noqa: F401  (first: gRPC fork support off before gRPC loads)
