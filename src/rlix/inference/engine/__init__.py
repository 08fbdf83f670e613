"""The embedded engine: continuous batching over a transformers model, one worker thread.

api.py (what the server sees), engine.py (TorchEngine: asyncio outside, worker inside), core.py
(state machine and step loop), model_runner.py, kv_cache.py, cuda_graphs.py, sequence.py,
sampling.py, weights.py (served parameters and their updates), memory.py.
"""
