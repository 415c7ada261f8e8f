"""The engine: per owned shard, consume inputs, fold, route, append, dispatch."""
