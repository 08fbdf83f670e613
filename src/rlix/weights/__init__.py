"""Weight sync: the trainer's weights, in buckets, from a CPU cache to chosen inference shards.

buckets.py   layout (computed once) and packing          receiver.py  decoding, torch-only
cache.py     versioned host cache (latest + active)      transport/   local, shm, cuda_ipc, nccl
endpoint.py  a shard's receiving end + driver interface  remote.py    a shard in another process
sync.py      selective sync to a set of DP ranks         apply.py     loading into a model
"""

from rlix.weights.apply import ModelEngine, load_into_model
from rlix.weights.buckets import named_weights, pack, plan_layout, unpack
from rlix.weights.cache import BucketCache
from rlix.weights.shard_updater import InProcessEndpoint, ShardEndpoint, ShardReceiver, WeightTarget
from rlix.weights.wire import BucketAssembler, Layout, bucket_checksum
from rlix.weights.sync import SyncReport, WeightSync

__all__ = ["BucketAssembler", "BucketCache", "InProcessEndpoint", "Layout", "ModelEngine",
           "ShardEndpoint", "ShardReceiver", "SyncReport", "WeightSync", "WeightTarget",
           "bucket_checksum", "load_into_model", "named_weights", "pack", "plan_layout", "unpack"]
