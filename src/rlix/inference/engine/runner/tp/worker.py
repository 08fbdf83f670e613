"""`python -m rlix.inference.engine.runner.tp.worker`: one worker rank of a tensor-parallel
engine (tp/group.py). It reads its RankSpec from stdin, joins the group, loads the model and
keeps its slices, builds a ModelRunner over them and answers "ready"; then it makes every call
rank 0 sends, in order, until Op.EXIT, the end of stdin, or rank 0's process is gone.

A worker computes what rank 0 computes but samples nothing: its forwards' logits are dropped
(rank 0 samples from the same logits), and a decode step chained on the step before
(`launch_plain` with `after`) reads this rank's own picks of that step, which equal rank 0's (the
same logits, the same draws). A call that fails is answered with the error when rank 0 waits for
an answer; a forward that fails ends the worker (rank 0 then fails the group: tp/group.py).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from rlix.devices import DeviceMemory
from rlix.inference.engine.runner.cuda_graphs import DecodeLaunch
from rlix.inference.engine.runner.model_runner import KeptRows, ModelRunner
from rlix.inference.engine.runner.tp.plan import TensorParallel
from rlix.inference.engine.runner.tp.group import (Call, Op, RankSpec, Reply, SharedTensors, join_group, load_rank,
                                                   read_message, write_message)
from rlix.inference.engine.weights import WeightStaging

log = logging.getLogger("rlix.tp_worker")
PARENT_POLL_S = 0.5


class Worker:
    """One rank's runner and what it keeps between calls: the step it launched last and the
    weight update it is staging."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.last: DecodeLaunch | None = None
        self.staging: WeightStaging | None = None
        self.kept: dict[int, KeptRows] = {}  # this rank's copies of the rows rank 0's prefix cache keeps
        self.handlers: dict[Op, Callable[..., Any]] = {
            Op.PREFILL: self._prefill,
            Op.LAUNCH: self._launch,
            Op.DECODE: self._decode,
            Op.CAPTURE: runner.capture_graphs,
            Op.ALLOCATE: runner.allocate_cache,
            Op.ENSURE_CAPACITY: runner.ensure_capacity,
            Op.COPY_ROWS: runner.copy_rows,
            Op.MOVE_ROWS: runner.move_rows,
            Op.KEEP_ROWS: self._keep_rows,
            Op.LOAD_ROWS: self._load_rows,
            Op.FORGET_ROWS: self._forget_rows,
            Op.FREE_FOR_SLEEP: runner.free_for_sleep,
            Op.RELEASE_MEMORY: runner.release_memory,
            Op.WAKE: runner.wake,
            Op.OPEN_UPDATE: self._open_update,
            Op.STAGE: self._stage,
            Op.ABANDON_UPDATE: self._abandon,
            Op.COMMIT_UPDATE: self._commit,
            Op.CHECKSUMS: runner.weight_checksums,
            Op.MEASURE: runner.measure_memory,
        }

    def _prefill(self, prompts: list[list[int]], first_row: int, every: frozenset[int],
                 offsets: list[int] | None) -> None:
        self.runner.prefill_all(prompts, first_row, every, offsets)

    def _launch(self, tokens: list[int], positions: list[int], uniforms: list[float],
                temperatures: list[float], chained: bool) -> None:
        after = self.last if chained else None
        if chained and after is None:
            raise RuntimeError("a chained decode step arrived with no step before it")
        self.last = self.runner.launch_plain(tokens, positions, uniforms, temperatures, after)

    def _keep_rows(self, row: int, length: int, key: int) -> None:
        self.kept[key] = self.runner.keep_rows(row, length, key)

    def _load_rows(self, key: int, row: int, length: int) -> None:
        self.runner.load_rows(self.kept[key], row, length)

    def _forget_rows(self, key: int) -> None:
        self.kept.pop(key, None)

    def _decode(self, tokens: list[int], positions: list[int]) -> None:
        self.runner.decode(tokens, positions)

    def _open_update(self, version: int, allow_partial: bool) -> None:
        self.staging = self.runner.open_update(version, allow_partial)

    def _stage(self, shared: SharedTensors) -> None:
        staging = self._staging()
        with shared.open() as named:
            self.runner.stage(staging, named)
            staging.wait_copies()  # the file is unmapped when this block ends

    def _abandon(self) -> None:
        if self.staging is not None:
            self.runner.abandon_update(self.staging)
        self.staging = None

    def _commit(self) -> None:
        staging, self.staging = self._staging(), None
        self.runner.commit_update(staging)

    def _staging(self) -> WeightStaging:
        if self.staging is None:
            raise RuntimeError("no weight update is open on this rank")
        return self.staging

    def serve(self, stdin: Any, stdout: Any) -> int:
        while True:
            call = read_message(stdin)
            if call is None or not isinstance(call, Call) or call.op is Op.EXIT:
                return 0
            try:
                value = self.handlers[call.op](*call.args)
            except Exception as exc:  # noqa: BLE001 - answered to rank 0, or fatal below
                if not call.reply:
                    log.exception("tensor parallel rank %d: %s failed", self.runner.tp.rank, call.op.value)
                    return 1
                write_message(stdout, Reply(False, error=f"{call.op.value}: {type(exc).__name__}: {exc}"))
                continue
            if call.reply:
                write_message(stdout, Reply(True, value if isinstance(value, (bool, int, float, DeviceMemory))
                                            else None))


def _replies_only() -> BinaryIO:
    """The pipe rank 0 reads replies from, kept on a descriptor of its own; file descriptor 1
    then points at stderr, so that nothing else (a print, a C library's banner: NCCL writes its
    version there) lands among the replies."""
    sys.stdout.flush()
    replies = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return open(replies, "wb")  # noqa: SIM115 - the process's own, open until it exits


def _exit_with_parent(parent: int) -> None:
    """End this process when rank 0's is gone (re-parented), whatever it is blocked in."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(3)
    threading.Thread(target=watch, name="rlix-tp-parent", daemon=True).start()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _exit_with_parent(os.getppid())
    stdin, stdout = sys.stdin.buffer, _replies_only()
    spec = read_message(stdin)
    if not isinstance(spec, RankSpec):
        return 2
    device = torch.device(spec.device)
    group = join_group(spec)
    tp = TensorParallel(spec.rank, spec.size, group)
    try:
        dtype = getattr(torch, spec.dtype) if spec.dtype else None
        model = load_rank(Path(spec.model_path), device, dtype, spec.rank, spec.size)
        o = spec.options
        runner = ModelRunner(model, device=device, num_rows=o.num_rows, max_model_len=o.max_model_len,
                             kv_initial_capacity=o.kv_initial_capacity, cuda_graphs=o.cuda_graphs,
                             fused=o.fused, virtual_memory=o.virtual_memory, tp=tp)
    except Exception as exc:  # noqa: BLE001 - told to rank 0, which raises it
        write_message(stdout, Reply(False, error=f"{type(exc).__name__}: {exc}"))
        return 1
    write_message(stdout, Reply(True))
    return Worker(runner).serve(stdin, stdout)


if __name__ == "__main__":
    sys.exit(main())
