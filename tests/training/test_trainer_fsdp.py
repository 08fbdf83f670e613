"""FSDP2 over two gloo ranks (training/fsdp.py) against one unsharded rank with the whole batch:
the same bytes in the cache before training, the same gradients, KL term and (to float noise)
weights after two steps with a fresh process group per step (a KL penalty to the sharded
reference model included); offload and reload keep the shards; a checkpoint resumes them
exactly, and its Hugging Face export loads in transformers."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM

from rlix.httpkit import free_port
from rlix.models import PRESETS, build_preset
from rlix.training.fsdp import ShardedPolicyTrainer, shard_rows
from rlix.training.trainer import PolicyTrainer
from rlix.weights.cache import BucketCache
from rlix.errors import TrainingError
from trainer_helpers import capture_grads, grads_close, weights_close

WORKER = Path(__file__).with_name("fsdp_worker.py")


def test_shard_rows_split_as_torch_chunk():
    for rows in (0, 1, 2, 5, 7, 8, 896):
        for world in (2, 3, 4):
            full = torch.arange(rows)
            chunks = torch.chunk(full, world) if rows else ()
            for rank in range(world):
                lo, hi = shard_rows(rows, world, rank)
                want = chunks[rank] if rank < len(chunks) else full[:0]
                assert torch.equal(full[lo:hi], want), (rows, world, rank)


def test_one_rank_is_refused(tiny_model_dir):
    with pytest.raises(TrainingError, match="at least 2 ranks"):
        ShardedPolicyTrainer(str(tiny_model_dir))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")])])
def test_two_fsdp_ranks_match_one_unsharded_rank(tiny_model_dir, samples_factory, tmp_path, device):
    """On CPU two gloo ranks; on CUDA two GPUs with NCCL, where the offload and reload move the
    shards and moments off the GPU and back (the unsharded rank trains on the host)."""
    micro, kl = 2, 0.05
    single = PolicyTrainer(str(tiny_model_dir), micro_batch_size=micro, kl_coef=kl)
    single_grads = capture_grads(single)
    v0 = BucketCache.for_model(single.state_for_sync(), bucket_bytes=single.cache_bucket_bytes, host="pageable")
    v0.build_latest(0, single.state_for_sync())
    batches = [samples_factory(8, seed=70 + i, trainer=single) for i in range(2)]
    ports = ",".join(str(free_port()) for _ in range(len(batches) + 3))
    procs = []
    for rank in range(2):
        share = [[dataclasses.asdict(s) for s in b[rank * 4:(rank + 1) * 4]] for b in batches]
        path = tmp_path / f"batches{rank}.json"
        path.write_text(json.dumps(share))
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(tiny_model_dir), str(rank), "2", str(micro), ports,
             str(path), str(tmp_path / f"out{rank}.pt"), str(tmp_path / "ckpt"), device, str(kl)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # three processes on a small host: oversubscribed threads crawl
    try:
        expected = [single.train_step(b) for b in batches]
        for p in procs:
            out, _ = p.communicate(timeout=180)
            assert p.returncode == 0, out.decode(errors="replace")[-3000:]
    finally:
        torch.set_num_threads(threads)
        for p in procs:
            if p.poll() is None:
                p.kill()  # by this Popen's own pid
    results = [torch.load(tmp_path / f"out{r}.pt", weights_only=False) for r in range(2)]
    # version 0: every rank's rows written into rank 0's cache give the unsharded trainer's bytes
    assert len(results[0]["v0"]) == len(v0.buckets(0))
    assert all(torch.equal(a, b) for a, b in zip(results[0]["v0"], v0.buckets(0)))
    for r in results:
        assert r["initialized_after"] is False  # no group outlived its step
        assert r["reload_equal"] and r["resumed_equal"]
        assert r["offloaded_to"] == {"cpu"} and r["reloaded_to"] == {device}
        for step, (got, exp) in enumerate(zip(r["metrics"], expected)):
            assert got["num_samples"] == 8 and got["num_tokens"] == exp["num_tokens"], step
            tol = 1e-4 if device == "cpu" else 1e-3  # GPU against host: other kernels, other float order
            assert got["loss"] == pytest.approx(exp["loss"], rel=tol, abs=1e-5)
            assert got["grad_norm"] == pytest.approx(exp["grad_norm"], rel=tol)
            assert got["entropy"] == pytest.approx(exp["entropy"], rel=tol) and got["entropy"] > 0
            # the reference is the initial policy: no KL before the first update, some after it
            assert got["kl"] == pytest.approx(exp["kl"], rel=10 * tol, abs=1e-6)
        assert r["metrics"][0]["kl"] == pytest.approx(0.0, abs=1e-6) and r["metrics"][1]["kl"] > 1e-6
        assert r["ref_offloaded_to"] == {"cpu"} and r["ref_unchanged"]
    # the gradients each step applied: rank 0's rows then rank 1's make the unsharded gradient
    rows = results[0]["rows"]
    for step, want in enumerate(single_grads):
        got = {n: torch.cat([results[r]["grads"][step][n] for r in range(2)]) for n in rows}
        assert grads_close(got, want, rel=1e-4 if step == 0 and device == "cpu" else 1e-3), step
    # the version trained, read back from the cache: the unsharded trainer's weights after the same steps
    want = single.state_for_sync()
    assert results[0]["v1_tensors"].keys() == want.keys()
    assert weights_close(results[0]["v1_tensors"], want, lr=1e-3, steps=2)
    # the checkpoint (torch.distributed.checkpoint) holds the whole tensors: any number of ranks
    # can read it; consolidated, each parameter is rank 0's rows then rank 1's
    dcp_to_torch_save(tmp_path / "ckpt" / "dcp", tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert whole["trainer_step"] == 2
    for name in rows:
        assert torch.equal(whole["model"][name], torch.cat([results[r]["shards"][name] for r in range(2)])), name
    # the checkpoint's Hugging Face export is that version, as transformers loads it
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model")
    assert all(torch.equal(t, exported.state_dict()[n]) for n, t in results[0]["v1_tensors"].items())
    assert (tmp_path / "ckpt" / "model" / "tokenizer.json").is_file() or \
        (tmp_path / "ckpt" / "model" / "tokenizer_config.json").is_file()


@pytest.mark.parametrize("source", ["checkpoint", "seeded"])
def test_a_rank_keeps_exactly_its_rows_without_loading_the_whole_model(tiny_model_dir, tmp_path, source):
    """A rank's shards are the unsharded trainer's rows of each parameter (as float32): read
    from the checkpoint's safetensors, or drawn for a seeded preset (models/init.py)."""
    folder = tiny_model_dir
    if source == "seeded":
        folder = build_preset("tiny-seeded", tmp_path / "tiny-seeded",
                              preset=dataclasses.replace(PRESETS["tiny"], weights="seeded"))
    whole = dict(PolicyTrainer(str(folder)).model.named_parameters())
    for rank in range(2):
        sharded = ShardedPolicyTrainer(str(folder), rank=rank, world_size=2)
        assert sharded.shards.keys() == whole.keys()
        for name, shard in sharded.shards.items():
            lo, hi = shard_rows(whole[name].shape[0], 2, rank)
            assert shard.dtype == torch.float32 and torch.equal(shard.detach(), whole[name].detach()[lo:hi].float()), name
        assert sharded.model.device.type == "meta"  # the model itself is never materialised
