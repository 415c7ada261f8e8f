"""The shard-manager role: membership, leader election, shard assignment with epochs."""
