"""Weight sync: packed buckets, a versioned CPU bucket cache, transports (shm, CUDA IPC, NCCL).

Work in progress (issue 4): the bucket layout and receiver are tested (tests/weights/); the
cache, the transports and selective sync are not yet.
"""
