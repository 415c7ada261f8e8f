"""The checkpointer role. Built so far: membership and shard leases.
Not built yet: epoch barriers (checkpoint.committed) and sealing noetl.checkpoint."""
