"""The checkpointer role: 1 s epoch barriers per shard, sealed in noetl.checkpoint once
both the engine and the projection have passed them."""
