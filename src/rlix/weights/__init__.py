"""Weight sync: packed buckets, a versioned CPU bucket cache, transports (shm, CUDA IPC, NCCL).

Work in progress (issue 4): the bucket layout, the receiver and the shm transport (across
processes) are tested (tests/weights/); the cache, the CUDA IPC and NCCL transports are not yet,
and selective sync (sync.py) is still to be written.
"""
