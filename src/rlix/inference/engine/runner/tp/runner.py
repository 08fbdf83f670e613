"""Rank 0 of a tensor-parallel engine: a ModelRunner over its own slices that sends each call
changing device state to the other ranks (tp/group.py) before making it itself.

Forwards (prefill, decode, graph capture) are sent without waiting: the workers make them while
rank 0 does, and the all-reduces inside keep the ranks in step. Calls without a collective wait
for every worker's answer where the caller relies on the result: memory released by a sleep
(the next holder of those GPUs may be told the room is free), a wake, a weight update's steps
(a worker that refuses one must fail it here, before any rank serves it). A weight update's full
tensors reach the workers once, through one shared-memory file per batch (SharedTensors); each
rank keeps its slices.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rlix.devices import DeviceMemory
from rlix.errors import EngineStateError, WeightUpdateError
from rlix.inference.engine.runner.cuda_graphs import DecodeLaunch
from rlix.inference.engine.runner.model_runner import KeptRows, ModelRunner
from rlix.inference.engine.runner.tp.group import Op, RankGroup, SharedTensors
from rlix.inference.engine.weights import WeightStaging


def tightest(reports: list[DeviceMemory]) -> DeviceMemory:
    """The report of the device with the least memory free (the first on CPUs, where none is
    measured)."""
    return min(reports, key=lambda r: r.device_free if r.device_free is not None else 0)


class TensorParallelRunner(ModelRunner):
    """ModelRunner on rank 0 of `group` (see module docstring); `model` holds rank 0's slices."""

    def __init__(self, model: torch.nn.Module, group: RankGroup, **kwargs: object) -> None:
        self.group = group
        self._last: DecodeLaunch | None = None
        super().__init__(model, tp=group.tp, **kwargs)  # type: ignore[arg-type]

    def failure(self) -> str | None:
        return self.group.poll()

    def measure_memory(self) -> DeviceMemory:
        """The tightest of the group's GPUs (least free): a sleep has released the shard's GPUs
        only when every one of them has room again."""
        return tightest([super().measure_memory(), *self.group.call(Op.MEASURE, reply=True)])

    @contextmanager
    def _collective(self) -> Iterator[None]:
        """A collective that fails because a rank is gone says so (EngineStateError naming it)."""
        try:
            yield
        except RuntimeError as exc:
            failure = self.group.poll()
            if failure is None:
                raise
            raise EngineStateError(failure) from exc

    # -- forwards --------------------------------------------------------------------------
    def prefill_all(self, prompts: list[list[int]], first_row: int,
                    every_position: frozenset[int] = frozenset(), offsets: list[int] | None = None
                    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        self.group.call(Op.PREFILL, prompts, first_row, every_position, offsets)
        with self._collective():
            return super().prefill_all(prompts, first_row, every_position, offsets)

    def launch_plain(self, tokens: list[int], positions: list[int], uniforms: list[float],
                     temperatures: list[float], after: DecodeLaunch | None) -> DecodeLaunch:
        if after is not None and after is not self._last:
            raise RuntimeError("a chained decode step must follow the step launched last: the "
                               "other ranks chain on their own last step")
        self.group.call(Op.LAUNCH, tokens, positions, uniforms, temperatures, after is not None)
        with self._collective():
            self._last = super().launch_plain(tokens, positions, uniforms, temperatures, after)
        return self._last

    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        self.group.call(Op.DECODE, tokens, positions)
        with self._collective():
            return super().decode(tokens, positions)

    def capture_graphs(self) -> None:
        self.group.call(Op.CAPTURE)
        with self._collective():
            super().capture_graphs()

    # -- the KV cache's rows ---------------------------------------------------------------
    def allocate_cache(self) -> None:
        self.group.call(Op.ALLOCATE, reply=True)
        super().allocate_cache()

    def ensure_capacity(self, length: int, live_rows: int, live_len: int) -> None:
        self.group.call(Op.ENSURE_CAPACITY, length, live_rows, live_len)
        super().ensure_capacity(length, live_rows, live_len)

    def copy_rows(self, src: int, dsts: list[int], length: int) -> None:
        self.group.call(Op.COPY_ROWS, src, dsts, length)
        super().copy_rows(src, dsts, length)

    def move_rows(self, srcs: list[int], dsts: list[int], length: int) -> None:
        self.group.call(Op.MOVE_ROWS, srcs, dsts, length)
        super().move_rows(srcs, dsts, length)

    # -- rows kept for later prompts -------------------------------------------------------
    def keep_rows(self, row: int, length: int, key: int | None = None) -> KeptRows:
        kept = super().keep_rows(row, length, key)
        self.group.call(Op.KEEP_ROWS, row, length, kept.key)
        return kept

    def load_rows(self, kept: KeptRows, row: int, length: int) -> None:
        self.group.call(Op.LOAD_ROWS, kept.key, row, length)
        super().load_rows(kept, row, length)

    def forget_rows(self, kept: KeptRows) -> None:
        self.group.call(Op.FORGET_ROWS, kept.key)

    # -- sleep and wake --------------------------------------------------------------------
    def free_for_sleep(self, level: int) -> bool:
        self.group.call(Op.FREE_FOR_SLEEP, level)
        return super().free_for_sleep(level)

    def release_memory(self, keep_workspaces: bool) -> None:
        super().release_memory(keep_workspaces)
        self.group.call(Op.RELEASE_MEMORY, keep_workspaces, reply=True)  # every rank's memory is free

    def wake(self, weights: bool, kv_cache: bool) -> None:
        self.group.call(Op.WAKE, weights, kv_cache, reply=True)
        super().wake(weights, kv_cache)

    # -- weight updates --------------------------------------------------------------------
    def open_update(self, version: int, allow_partial: bool) -> WeightStaging:
        self.group.call(Op.OPEN_UPDATE, version, allow_partial, reply=True)
        return super().open_update(version, allow_partial)

    def stage(self, staging: WeightStaging, named: dict[str, torch.Tensor]) -> None:
        super().stage(staging, named)  # a refused batch is refused here, before the workers see it
        shared, segment = SharedTensors.pack(named)
        try:
            self.group.call(Op.STAGE, shared, reply=True)
        finally:
            segment.close()

    def abandon_update(self, staging: WeightStaging) -> None:
        super().abandon_update(staging)
        self.group.call(Op.ABANDON_UPDATE, reply=True)

    def commit_update(self, staging: WeightStaging) -> None:
        try:
            staging.check_complete()  # an update that may not be served fails on every rank
        except WeightUpdateError:
            self.group.call(Op.ABANDON_UPDATE, reply=True)
            raise
        self.group.call(Op.COMMIT_UPDATE, reply=True)
        super().commit_update(staging)

    def weight_checksums(self) -> dict[str, int]:
        self.group.call(Op.CHECKSUMS)  # the workers join the gathers
        with self._collective():
            return super().weight_checksums()

    def close(self) -> None:
        self.group.close()
