"""The projector role: folds each owned shard's events into the read models."""
