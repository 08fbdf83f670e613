"""Running the model on its device: the KV cache, the fused decoder with its Triton kernels,
CUDA graphs, memory release and the per-step profile. The engine above it schedules requests;
this package only executes a batch."""
