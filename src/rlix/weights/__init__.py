"""Weight sync: the trainer's weights, in buckets, from a CPU cache to chosen inference shards.

Two verbs: a trainer *publishes* a version into its cache; the pipeline's WeightPath *refits*
chosen shards to it, each through the route that reaches it.

api.py            the Protocols (WeightRoute, endpoints, engine target) and typed values
refit.py          WeightPath (publish, refit: the pipeline's one driver); host and device routes
buckets.py        layout (computed once) and packing           wire.py   the wire format, torch-only
cache.py          versioned host cache (latest + active)       transport/  local, shm, cuda_ipc, nccl
sync.py           WeightSync: an in-process driver over any transport (tests, benches)
nodes/            other nodes: relay.py (a version streamed over TCP into a node's replica),
                  node_cache.py (NodeCacheActor: a pipeline's replica on one node; its route)
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
