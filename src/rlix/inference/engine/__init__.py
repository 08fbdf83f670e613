"""The embedded engine: continuous batching over a transformers model, one worker thread.

api.py (what the server sees), engine.py (TorchEngine: asyncio outside, worker inside), outputs.py, core.py
(state machine and step loop), model_runner.py, fused_model.py (the forward over the model's
parameters), triton_ops.py (GPU decode kernels), kv_cache.py, cuda_graphs.py, sequence.py,
sampling.py, profile.py (where a step's time goes), weights.py (served parameters and their
updates), memory.py.
"""
