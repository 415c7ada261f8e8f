"""`make bench`: the runtime's performance story, measured on the embedded local stack and
side by side with Temporal and Prefect (see bench/README.md and docs/BENCHMARKS.md)."""

import noetl_common  # noqa: F401  (first: gRPC fork support off before gRPC loads)
