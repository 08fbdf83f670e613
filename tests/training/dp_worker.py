"""One data-parallel trainer rank, run as a subprocess by test_trainer_dp.py.

argv: model_dir rank world_size micro_batch_size ports(comma-separated, one per step)
      batches.json (one list of sample dicts per step, this rank's share) out.pt [device]
(device defaults to cpu with gloo; a cuda device picks nccl.)
"""

from __future__ import annotations

import json
import sys

import torch

from rlix.training.trainer import PolicyTrainer
from rlix.training.types import GroupSpec, TrainSample
from trainer_helpers import capture_grads


def main(argv: list[str]) -> None:
    model, rank, world, micro, ports, batches_path, out = argv[:7]
    device = argv[7] if len(argv) > 7 else "cpu"
    torch.set_num_threads(1)  # two ranks share the host's cores; tiny matmuls gain nothing from more
    trainer = PolicyTrainer(model, rank=int(rank), world_size=int(world), micro_batch_size=int(micro),
                            device=device)
    grads = capture_grads(trainer)
    metrics = []
    with open(batches_path) as fh:
        batches = json.load(fh)
    for port, batch in zip(ports.split(","), batches):
        group = GroupSpec("127.0.0.1", int(port), int(rank), int(world), timeout_s=60)
        metrics.append(trainer.train_step([TrainSample(**s) for s in batch], group=group))
    weights = {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}
    torch.save({"weights": weights, "metrics": metrics, "grads": grads,
                "initialized_after": torch.distributed.is_initialized()}, out)


if __name__ == "__main__":
    main(sys.argv[1:])
