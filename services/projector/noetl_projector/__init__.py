"""The projector role: folds each owned shard's events into the read models."""

import noetl_common  # noqa: F401  (first: gRPC fork support off before gRPC loads)
