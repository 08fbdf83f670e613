"""The program's training state on its GPU, handed over the way rlix's own trainer hands its own.

Between before_training and after_training the GPUs are the program's; outside that window the
scheduler gives them to shards (this pipeline's and others'). So at after_training (and at
start, before the GPUs were ever granted) the client moves the model's parameters and buffers
and the optimizer's moments into page-locked host memory, frees what the allocator cached,
measures that the GPU has room for its next holder (tolerating residue, measuring again before
it gives up), and only then tells rlix the GPUs are free; at before_training it waits, measured,
until the GPU has room for the state again and moves it back. The same hand-off checks as the
native trainer's (rlix.devices), so a program cannot fail a healthy pipeline or hold memory the
scheduler gave away.

A program whose model lives on the CPU (or fake GPUs) has nothing to move: no TrainingState.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from rlix.devices import (RELEASE_RETRIES, RELEASE_RETRY_S, DeviceMemory, measure, release_and_measure,
                          release_shortfall, wait_for_free)
from rlix.errors import GpuMemoryError
from rlix.training.offload import HostOffload, StateTensor, module_tensors, optimizer_tensors, state_bytes
from rlix.training.trainer import RELOAD_MARGIN_BYTES


class TrainingState:
    """A CUDA model and its optimizer, moved off the GPU and back (see module doc). Built by
    `TrainingState.of`; `on_device` says where the state is now."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.offload = HostOffload(device)
        self.on_device = True
        self.last_release_s = 0.0
        self.last_reload_s = 0.0

    @classmethod
    def of(cls, weights: object, optimizer: torch.optim.Optimizer | None) -> TrainingState | None:
        """The state to move when `weights` is a module on a CUDA device, else None."""
        if not isinstance(weights, torch.nn.Module):
            return None
        first = next(iter(weights.parameters()), None)
        if first is None or first.device.type != "cuda":
            return None
        return cls(weights, optimizer, first.device)

    def tensors(self) -> Iterator[StateTensor]:
        yield from module_tensors(self.model)
        if self.optimizer is not None:
            yield from optimizer_tensors(self.optimizer)

    def reload_bytes(self) -> int:
        """What this state needs free to come back, and what its release must leave free."""
        return state_bytes(self.tensors()) + RELOAD_MARGIN_BYTES

    def release(self, gpu: str, holder: str) -> DeviceMemory:
        """Move the state to host memory and free the GPU, measured. Raises GpuMemoryError when
        the GPU keeps too little free for the next holder after RELEASE_RETRIES measurements."""
        t0 = time.perf_counter()
        need = self.reload_bytes()
        if self.on_device:
            self.model.zero_grad(set_to_none=True)  # gradients are not state: dropped, not moved
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            self.offload.move(self.tensors(), torch.device("cpu"))
            self.on_device = False
        report = release_and_measure(self.device)
        for attempt in range(RELEASE_RETRIES + 1):
            why = release_shortfall(report, holder=holder, gpu=gpu, need_bytes=need)
            if why is None:
                break
            if attempt == RELEASE_RETRIES:
                raise GpuMemoryError(f"{why} (measured {RELEASE_RETRIES + 1} times)")
            time.sleep(RELEASE_RETRY_S)
            report = release_and_measure(self.device)
        self.last_release_s = time.perf_counter() - t0
        return report

    def reload(self, gpu: str, holder: str, timeout_s: float) -> DeviceMemory:
        """Wait until the GPU has room for the state (its previous holders let go), then move it
        back. Raises GpuMemoryError naming the GPU when it never has."""
        t0 = time.perf_counter()
        if self.on_device:
            return measure(self.device)
        report = wait_for_free(self.device, self.reload_bytes(), holder=holder, gpu=gpu, timeout_s=timeout_s)
        self.offload.move(self.tensors(), self.device)
        self.on_device = True
        self.last_reload_s = time.perf_counter() - t0
        return report
