"""Weight sync: the trainer's weights, in buckets, from a CPU cache to chosen inference shards.

Two verbs: a trainer *publishes* a version into its cache; the driver *syncs* shards to it.

api.py            the driver's and the shard's Protocols, the typed SyncReport
buckets.py        layout (computed once) and packing           wire.py   the wire format, torch-only
cache.py          versioned host cache (latest + active)       transport/  local, shm, cuda_ipc, nccl
sync.py           WeightSync: selective sync to a set of DP ranks (the driver)
push.py           the driver in the trainer's process, over HTTP
nodes/            other nodes: relay.py (a version streamed over TCP into a node's replica),
                  node_cache.py (NodeCacheActor: a pipeline's replica on one node, and its syncs)
vllm/             rlix's side of vLLM shards (endpoint, fused names); vllm_worker.py is the
                  extension inside vLLM, staged with wire.py as a package of its own
http_endpoint.py  the one HTTP client of a shard's weight endpoints
shard_updater.py  a shard's end: buckets in, the engine's update protocol out
"""

from rlix.weights.api import ShardEndpoint, SyncReport, WeightTarget
from rlix.weights.buckets import named_weights, pack, plan_layout, unpack
from rlix.weights.cache import BucketCache
from rlix.weights.shard_updater import InProcessEndpoint, ShardUpdater
from rlix.weights.sync import WeightSync
from rlix.weights.wire import BucketAssembler, Layout, bucket_checksum

__all__ = ["BucketAssembler", "BucketCache", "InProcessEndpoint", "Layout", "ShardEndpoint",
           "ShardUpdater", "SyncReport", "WeightSync", "WeightTarget", "bucket_checksum",
           "named_weights", "pack", "plan_layout", "unpack"]
