"""The reaper role: finds commands whose claim lease expired (worker lost) and
commands left queued, and reports them to the owning engine / republishes them."""

import noetl_common  # noqa: F401  (first: gRPC fork support off before gRPC loads)
