"""Tensor parallelism of the embedded engine: one model split over several GPUs (or, on the CPU,
processes), one process per rank.

plan.py    which slice of each weight a rank keeps (ShardPlan) and the group's collectives
           (TensorParallel): what the fused decoder needs to run on a slice
group.py   rank 0's side of the processes: the workers it starts, their pipes, the group
runner.py  rank 0's ModelRunner, sending each device-changing call to the other ranks
worker.py  `python -m rlix.inference.engine.runner.tp.worker`: one further rank
"""
