"""The embedded engine: continuous batching over a transformers model, one worker thread.

api.py (what the server sees), engine.py (TorchEngine: asyncio outside, worker inside), outputs.py, core.py
(state machine and step loop), sequence.py, sampling.py, weights.py (served parameters and their
updates), runner/ (executing a batch on the device: model runner, fused decoder, Triton kernels,
KV cache, CUDA graphs, profile, memory).
"""
