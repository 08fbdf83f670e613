"""One FSDP2 trainer rank, run as a subprocess by test_trainer_fsdp.py.

argv: model_dir rank world_size micro_batch_size ports(comma-separated: one for the exchange
      store, then one per step) batches.json (one list of sample dicts per step, this rank's
      share) out.pt ckpt_dir
Publishes version 0, trains every batch, offloads, reloads, publishes version 1, saves a
checkpoint and resumes a fresh trainer from it; out.pt holds what the test compares.
"""

from __future__ import annotations

import json
import pickle
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from rlix.training.fsdp import ShardedPolicyTrainer
from rlix.training.types import GroupSpec, TrainSample


def publish(trainer: ShardedPolicyTrainer, store: dist.TCPStore, version: int) -> list[torch.Tensor] | None:
    """What TrainerGroup.publish does across Ray, here across the exchange store."""
    if trainer.rank == 0:
        store.set(f"refs{version}", pickle.dumps(trainer.open_version(version)))
    refs = pickle.loads(store.get(f"refs{version}"))
    trainer.write_shard(refs)
    store.add(f"written{version}", 1)
    if trainer.rank != 0:
        return None
    while int(store.add(f"written{version}", 0)) < trainer.world_size:
        pass
    trainer.close_version(version)
    return [b.clone() for b in trainer.cache.buckets(version)]


def main(argv: list[str]) -> None:
    model, rank, world, micro, ports, batches_path, out, ckpt = argv[:8]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)  # two ranks share the host's cores; tiny matmuls gain nothing from more
    store_port, *step_ports = (int(p) for p in ports.split(","))
    store = dist.TCPStore("127.0.0.1", store_port, world, rank == 0, timeout=timedelta(seconds=60))
    trainer = ShardedPolicyTrainer(model, rank=rank, world_size=world, micro_batch_size=int(micro),
                                   cache_host="shm")
    grads: list[dict] = []
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):  # the shard gradients each optimizer step applies
        grads.append({n: t.grad.detach().clone() for n, t in trainer.shards.items()})
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    result: dict = {"v0": publish(trainer, store, 0), "rows": trainer.rows}
    with open(batches_path) as fh:
        batches = json.load(fh)
    result["metrics"] = [trainer.train_step([TrainSample(**s) for s in batch],
                                            group=GroupSpec("127.0.0.1", port, rank, world, timeout_s=60))
                         for port, batch in zip(step_ports, batches)]
    result["grads"] = grads
    before = {n: t.detach().clone() for n, t in trainer.shards.items()}
    trainer.offload()
    trainer.reload()
    result["reload_equal"] = all(torch.equal(before[n], t) for n, t in trainer.shards.items())
    result["v1"] = publish(trainer, store, 1)
    if rank == 0:
        result["v1_tensors"] = {n: t.clone() for n, t in trainer.cached_weights(1).items()}
    trainer.save_checkpoint(ckpt)
    store.add("saved", 1)
    while int(store.add("saved", 0)) < world:
        pass
    resumed = ShardedPolicyTrainer(model, rank=rank, world_size=world, micro_batch_size=int(micro))
    resumed.load_checkpoint(ckpt)
    result["resumed_equal"] = (resumed.step == trainer.step and all(
        torch.equal(resumed.shards[n], t) for n, t in trainer.shards.items()) and
        torch.equal(resumed.optimizer.state_dict()["state"][0]["exp_avg"],
                    trainer.optimizer.state_dict()["state"][0]["exp_avg"]))
    result["initialized_after"] = dist.is_initialized()
    if trainer.cache is not None:
        trainer.cache.close()  # its shared memory unlinked
    torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1:])
