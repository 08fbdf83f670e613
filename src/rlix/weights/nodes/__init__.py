"""Weights on nodes other than the trainer's: a cached version streamed over TCP (relay.py) into
a replica cache held by one actor per node (node_cache.py), which syncs that node's shards."""
