"""One FSDP2 trainer rank, run as a subprocess by test_trainer_fsdp.py.

argv: model_dir rank world_size micro_batch_size ports(comma-separated: one for the exchange
      store, one per step, one for the checkpoint's save, one for its load) batches.json (one list of sample dicts per step, this rank's
      share) out.pt ckpt_dir [device: cpu (gloo, the default) or cuda (rank r on GPU r, nccl)]
      [kl_coef, default 0]
Publishes version 0, trains every batch, offloads, reloads, publishes the version trained, saves a
checkpoint (with its Hugging Face export) and resumes a fresh trainer from it; out.pt holds what the test compares.
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
    device = f"cuda:{rank}" if len(argv) > 8 and argv[8] == "cuda" else "cpu"
    kl = float(argv[9]) if len(argv) > 9 else 0.0
    torch.set_num_threads(1)  # two ranks share the host's cores; tiny matmuls gain nothing from more
    store_port, *step_ports, save_port, load_port = (int(p) for p in ports.split(","))
    store = dist.TCPStore("127.0.0.1", store_port, world, rank == 0, timeout=timedelta(seconds=60))
    trainer = ShardedPolicyTrainer(model, rank=rank, world_size=world, micro_batch_size=int(micro),
                                   cache_host="shm", device=device, kl_coef=kl)
    reference = {n: t.detach().cpu().clone() for n, t in trainer.ref_shards.items()}
    grads: list[dict] = []
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):  # the shard gradients each optimizer step applies
        grads.append({n: t.grad.detach().cpu().clone() for n, t in trainer.shards.items()})
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    result: dict = {"v0": publish(trainer, store, 0), "rows": trainer.rows}
    with open(batches_path) as fh:
        batches = json.load(fh)
    result["metrics"] = [trainer.train_step([TrainSample(**s) for s in batch],
                                            group=GroupSpec("127.0.0.1", port, rank, world, timeout_s=60))
                         for port, batch in zip(step_ports, batches)]
    result["grads"] = grads
    before = {n: t.detach().cpu().clone() for n, t in trainer.shards.items()}
    trainer.offload()
    result["offloaded_to"] = {t.device.type for t in trainer.shards.values()}
    result["ref_offloaded_to"] = {t.device.type for t in trainer.ref_shards.values()} or {"cpu"}
    trainer.reload()
    result["reload_equal"] = all(torch.equal(before[n], t.cpu()) for n, t in trainer.shards.items())
    result["reloaded_to"] = {t.device.type for t in trainer.shards.values()}
    # the reference stays the initial policy through two steps, an offload and a reload
    result["ref_unchanged"] = reference.keys() == trainer.ref_shards.keys() and all(
        torch.equal(reference[n], t.cpu()) for n, t in trainer.ref_shards.items())
    result["v1"] = publish(trainer, store, trainer.step)  # as the loop does: version = steps trained
    if rank == 0:
        result["v1_tensors"] = {n: t.clone() for n, t in trainer.cached_weights(trainer.step).items()}
    trainer.save_checkpoint(ckpt, GroupSpec("127.0.0.1", save_port, rank, world, timeout_s=60))
    result["shards"] = {n: t.detach().cpu().clone() for n, t in trainer.shards.items()}
    resumed = ShardedPolicyTrainer(model, rank=rank, world_size=world, micro_batch_size=int(micro), device=device,
                                   kl_coef=kl)
    resumed.load_checkpoint(ckpt, GroupSpec("127.0.0.1", load_port, rank, world, timeout_s=60))
    result["resumed_equal"] = (resumed.step == trainer.step and all(
        torch.equal(resumed.shards[n].cpu(), t.cpu()) for n, t in trainer.shards.items()) and
        torch.equal(resumed.optimizer.state_dict()["state"][0]["exp_avg"].cpu(),
                    trainer.optimizer.state_dict()["state"][0]["exp_avg"].cpu()))
    result["initialized_after"] = dist.is_initialized()
    if trainer.cache is not None:
        trainer.cache.close()  # its shared memory unlinked
    torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1:])
