"""The trainer's side of a GPU hand-off, on a real GPU: it reloads only into memory measured
free (else a clear error naming the GPU), offloads to pinned host memory and confirms the GPU
is free again."""

from __future__ import annotations

import gc

import pytest
import torch

from rlix.devices import RELEASE_SLACK_BYTES
from rlix.errors import GpuMemoryError
from rlix.training.trainer import PolicyTrainer
from rlix.training.types import TrainSample

pytestmark = pytest.mark.gpu


def batch() -> list[TrainSample]:
    return [TrainSample([1, 2, 3], [4 + i, 5, 6], [-1.0, -1.2, -0.8], 1.0 if i % 2 else -1.0) for i in range(4)]


def test_reload_waits_for_measured_free_memory_and_names_the_gpu(tiny_model_dir):
    # what this process holds already (an earlier GPU test in the same pytest run; it may be
    # freed meanwhile, so the trainer's offload must leave at most this): not the trainer's
    gc.collect()
    baseline = torch.cuda.memory_allocated()
    trainer = PolicyTrainer(tiny_model_dir, device="cuda", offloaded=True, lr=0.01)
    assert not trainer.on_device
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - (64 << 20), dtype=torch.uint8, device="cuda")  # a holder that did not let go
    with pytest.raises(GpuMemoryError, match=r"GPU 0: the trainer needs .* GiB but only"):
        trainer.reload(timeout_s=0.5, gpu="0")
    assert not trainer.on_device  # nothing half-moved
    del hog
    torch.cuda.empty_cache()
    trainer.reload(timeout_s=5, gpu="0")
    trainer.train_step(batch())
    before = {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}
    report = trainer.offload()
    assert report.reserved <= RELEASE_SLACK_BYTES and report.device_free is not None
    assert report.allocated <= baseline, report  # no tensor of the trainer is left on the GPU
    assert all(p.device.type == "cpu" and p.is_pinned() for p in trainer.model.parameters())
    trainer.reload(timeout_s=5, gpu="0")
    after = {n: p.detach().cpu() for n, p in trainer.model.named_parameters()}
    assert all(torch.equal(before[n], after[n]) for n in before)
    trainer.train_step(batch())  # the optimizer state came back too
    trainer.offload()


def test_an_offloaded_trainer_pins_its_host_state_at_set_up_and_the_first_offload_reuses_it(tiny_model_dir):
    """The pinned host buffers (parameters and the AdamW moments-to-be) exist from set-up: the
    first offload after the first step copies into them, allocating no pinned memory of its own."""
    trainer = PolicyTrainer(tiny_model_dir, device="cuda", offloaded=True, lr=0.01)
    assert all(p.is_pinned() for p in trainer.model.parameters())
    moments = {k: t.data_ptr() for k, t in trainer._offload.host.items() if k[0] == "opt"}
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    assert len(moments) == 2 * len(trainable)
    trainer.reload(timeout_s=5, gpu="0")
    trainer.train_step(batch())
    trainer.offload()
    after = {k: t.data_ptr() for k, t in trainer._offload.host.items() if k[0] == "opt"}
    assert after == moments, "the first offload reused the buffers pinned at set-up"
    for param in trainable:
        state = trainer.optimizer.state[param]
        assert state["exp_avg"].is_pinned() and state["exp_avg"].data_ptr() == moments[("opt", id(param), "exp_avg")]
    trainer.reload(timeout_s=5, gpu="0")
    trainer.train_step(batch())
