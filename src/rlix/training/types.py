"""Value types shared by the trainer and the pipeline; plain dataclasses, no torch, no Ray."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainSample:
    """One trajectory as the trainer consumes it.

    `behaviour_logprobs` are the logprobs of `response_ids` under the policy that sampled them
    (one per response token); `version` is that policy's weight version (for staleness checks).
    `loss_mask` (one 0/1 per response token; None: all 1) leaves out tokens the policy did not
    sample, such as tool outputs between the turns of an episode: they are context only.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    version: int = 0
    loss_mask: list[int] | None = None

    def trained_tokens(self) -> int:
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)


@dataclass(frozen=True)
class GroupSpec:
    """A fresh rendezvous for one data-parallel train step (new port per step, so no
    communicator outlives the step). `backend` None picks nccl on CUDA, gloo otherwise."""

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    backend: str | None = None
    timeout_s: float = 300.0


@dataclass
class GroupStats:
    """A data-parallel step's process group: seconds to make it and to destroy it, and whether
    torch.distributed was left without one afterwards (no communicator outlives the step)."""

    setup_s: float
    teardown_s: float = 0.0
    destroyed: bool = False
