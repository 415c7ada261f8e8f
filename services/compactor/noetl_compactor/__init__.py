"""The compactor role. Built so far: event partitions are created ahead of need.
Not built yet: retention (manifests, deleting compacted events, dropping partitions)."""
