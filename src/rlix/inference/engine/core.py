"""The engine's state machine and step loop, single-threaded and free of asyncio.

One `step()` = admit waiting requests into free rows and prefill them, then decode one token for
every running row, then retire finished rows. The n samples of one request are admitted together
and prefilled once: the others copy the prefilled cache row and sample their first token from
the same logits. Requests therefore join and leave the batch at
token granularity. Everything here runs on the engine's worker thread (engine.py), so control
operations (abort, pause, sleep, weight swaps) always land between two steps.

Overlapped decode (on by default with CUDA graphs): while no request is being admitted and every
row samples plainly (temperature or greedy), step k+1 is launched before step k's tokens are read,
its input tokens gathered on the device from step k's picks, so the host's work of a step
(recording tokens, stop checks, retiring, preparing inputs) runs while the device computes the
next one. A row that turns out to have finished at step k decoded one token too many in step k+1;
that token is dropped, and the row leaves the batch before step k+2. Anything else (admissions,
rows needing logits on the host, every control operation) first settles the step in flight.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

import torch

from rlix.errors import EngineStateError, InvalidRequestError
from rlix.inference.engine.api import Detokenizer, PauseMode
from rlix.inference.engine.batching import plan_prefill_groups, request_leaders, samples_from
from rlix.inference.engine.prefix_cache import PrefixCache
from rlix.inference.engine.runner.memory import device_resident_bytes, used_bytes
from rlix.inference.engine.runner.cuda_graphs import DecodeLaunch
from rlix.inference.engine.runner.model_runner import ModelRunner
from rlix.inference.engine.runner.profile import StepProfile
from rlix.inference.engine.sampling import Sampled, sample, top_alternatives
from rlix.inference.engine.sequence import Delta, Sequence
from rlix.inference.engine.stats import EngineStats
from rlix.inference.engine.weights import WeightStaging

log = logging.getLogger(__name__)

SLEEP_TAGS = ("weights", "kv_cache")


class EngineCore:
    """Waiting queue, running batch (row i of the KV cache = running[i]), pause and sleep state."""

    def __init__(self, runner: ModelRunner, detokenizer: Detokenizer, *, max_num_seqs: int,
                 eos_ids: Iterable[int], max_prefill_tokens: int = 4096,
                 max_prefill_padding: float | None = None, min_admit_batch: int | None = None,
                 max_admit_delay_steps: int | None = None, overlap: bool | None = None,
                 prefix_cache_bytes: int = 0) -> None:
        self.runner = runner
        self.weights = runner.weights
        self.detokenizer = detokenizer
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        # Padding costs compute on a CPU; on a GPU one more forward costs far more than padding.
        if max_prefill_padding is None:
            cpu_pads = runner.device.type == "cpu" and not runner.packs_prefill
            max_prefill_padding = 0.25 if cpu_pads else float("inf")
        self.max_prefill_padding = max_prefill_padding
        # While a batch runs, newcomers may wait (at most max_admit_delay_steps) until
        # min_admit_batch rows are free, so that one prefill forward serves several of them:
        # worth it on a GPU, where a forward's launch cost dwarfs its compute; off on a CPU.
        on_gpu = runner.device.type != "cpu"
        self.min_admit_batch = min_admit_batch or (max(1, max_num_seqs // 4) if on_gpu else 1)
        self.max_admit_delay_steps = (max_admit_delay_steps if max_admit_delay_steps is not None
                                      else (8 if on_gpu else 0))
        self._step_count = 0
        self._queued_at: dict[Sequence, int] = {}
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pause_mode: PauseMode | None = None
        self._held_at_pause: set[Sequence] = set()  # in flight when the pause began
        self.kv_asleep = False
        self.weight_version = 0
        self.last_sleep_freed_bytes = 0
        self.last_sleep_phases_ms: dict[str, float] = {}
        #: whether the last sleep kept the CUDA graphs (every address they hold was virtual)
        self.last_sleep_kept_graphs = False
        #: what the process still held on its CUDA device once the last sleep had released
        #: (torch's reserved memory + mapped virtual memory); None on CPU
        self.last_sleep_resident_bytes: int | None = None
        self.last_sleep_mapped_bytes = 0  # this engine's virtual memory still mapped (0 when sound)
        self._touched: dict[Sequence, None] = {}
        self.prefill_tokens = 0  # prompt tokens run through prefill forwards (shared ones once)
        #: finished rows' keys and values, for prompts that start with their tokens (a multi-turn
        #: episode's next turn); where the prefill can start mid-prompt (the fused decoder)
        self.prefixes = (PrefixCache(prefix_cache_bytes, on_drop=runner.forget_rows)
                         if prefix_cache_bytes > 0 and runner.reuses_prefixes else None)
        self.forked_rows = 0  # samples that copied another's prefill instead of running their own
        self.forked_prompt_tokens = 0  # the prompt tokens of those samples (copied, not computed)
        self.profile = StepProfile()
        #: what /metrics reports of the engine's own work (stats.py): tokens per step, each
        #: token's latency, each request's phases
        self.stats = EngineStats(runner.cache.max_len)
        self._step_tokens = 0  # tokens the step under way computed (prefilled + sampled)
        self._appended_at = 0.0  # when the last batch of tokens was recorded (_append)
        #: overlapped decode (module docstring): None = wherever decode runs through CUDA graphs
        self.overlap = runner.graphs is not None if overlap is None else overlap
        self._in_flight: DecodeLaunch | None = None
        self._in_flight_rows: list[Sequence] = []  # row i of the step in flight
        self.overlapped_steps = 0  # decode steps launched before the previous one was read
        #: called after a step's prefills when its decode runs synchronously (no overlap): the
        #: newcomers' first tokens reach their callers a decode step sooner (the engine posts them)
        self.on_prefilled: Callable[[], None] | None = None
        runner.allocate_cache()

    # -- queries -------------------------------------------------------------------------
    @property
    def sleeping(self) -> bool:
        return self.kv_asleep or not self.weights.on_device

    def check_can_generate(self) -> None:
        if not self.weights.loaded:
            raise EngineStateError("weights were dropped by a level-2 sleep; wake up and load "
                                   "them with start_weight_update / update_weights / "
                                   "finish_weight_update")
        if self.sleeping:
            raise EngineStateError("the engine is sleeping; wake it up first")

    def _admissible(self, seq: Sequence) -> bool:
        return self.pause_mode is None or (self.pause_mode == "wait" and seq in self._held_at_pause)

    def has_work(self) -> bool:
        if self.pause_mode == "keep" or self.sleeping or not self.weights.loaded:
            return False
        if self.running:
            return True
        return any(self._admissible(s) for s in self.waiting)

    def num_deferred(self) -> int:
        """Waiting requests a pause keeps out of the batch (read from other threads: the copy
        of the queue is one C call under the GIL)."""
        if self.pause_mode is None:
            return 0
        return sum(1 for s in list(self.waiting) if not self._admissible(s))

    def drained(self) -> bool:
        """True when nothing that was in flight at the pause is still running or waiting."""
        self._held_at_pause = {s for s in self._held_at_pause if not s.finished}
        return not self._held_at_pause

    # -- requests ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.check_can_generate()
        seq.hold_stops(self.eos_ids)
        self.waiting.append(seq)
        self._queued_at[seq] = self._step_count

    def add_group(self, seqs: list[Sequence]) -> None:
        """The samples of one request, queued together (admitted together, prefilled once)."""
        self.check_can_generate()
        self.waiting.extend(seqs)
        for seq in seqs:
            seq.hold_stops(self.eos_ids)
            self._queued_at[seq] = self._step_count

    def reject(self, seq: Sequence, error: BaseException) -> None:
        """End a request that never entered the engine, handing `error` to its caller."""
        seq.pending.error = error
        seq.finish("abort")
        self._touched[seq] = None

    def abort(self, request_ids: Iterable[str] | None = None) -> int:
        """End the named (or all) requests with finish_reason "abort"; return how many. A request
        of n samples is named by its id (all of them) or by a sample's."""
        self.settle()
        wanted = None if request_ids is None else set(request_ids)
        hit = [s for s in (*self.running, *self.waiting)
               if wanted is None or s.request_id in wanted or s.group_id in wanted]
        for seq in hit:
            seq.finish("abort")
            self._touched[seq] = None
            self._queued_at.pop(seq, None)
        self.waiting = deque(s for s in self.waiting if not s.finished)
        self._retire_finished()
        return len(hit)

    def collect(self) -> list[tuple[Sequence, Delta]]:
        """Deltas of every request changed since the last call."""
        out = []
        for seq in self._touched:
            delta = seq.take_delta()
            if delta is not None:
                out.append((seq, delta))
        self._touched.clear()
        return out

    # -- pause ---------------------------------------------------------------------------
    def pause(self, mode: PauseMode) -> None:
        if mode not in ("abort", "wait", "keep"):
            raise InvalidRequestError(f"unknown pause mode {mode!r}; use abort, wait or keep")
        self.settle()
        if self.pause_mode is None:
            self._held_at_pause = {*self.running, *self.waiting}
        self.pause_mode = mode
        if mode == "abort":
            self.abort(None)

    def resume(self) -> None:
        self.pause_mode = None
        self._held_at_pause = set()

    # -- the step ------------------------------------------------------------------------
    def step(self) -> None:
        self._step_count += 1
        self._step_tokens = 0
        admitted: list[Sequence] = []
        prof = self.profile
        try:
            prof.begin()
            launched, launched_rows = self._in_flight, self._in_flight_rows
            chained = launched is not None and self._can_chain()
            if launched is not None and not chained:
                self.settle()
                prof.mark("wait")
            elif chained:  # this step reads it (_chain): no later step may chain on it again
                self._in_flight, self._in_flight_rows = None, []
            # chained: the rows known finished leave now; the others' inputs are in flight
            sources = self._retire_finished(in_flight=True) if chained else []
            admitted = self._admit()
            leaders, forks = request_leaders(admitted)
            lengths = [len(s.prompt_token_ids) for s in leaders]
            groups = plan_prefill_groups(lengths, self.max_prefill_padding,
                                         self.runner.prefill_group_tokens
                                         or 2 * self.max_prefill_tokens)
            prof.mark("schedule")
            for group in groups:
                self._prefill([leaders[i] for i in group], forks)
            if groups:
                prof.mark("prefill")
                if self.on_prefilled is not None and not self.overlap:
                    self.on_prefilled()
            if chained:
                assert launched is not None
                self._chain(launched, launched_rows, sources)
            else:
                self._decode_now()
            prof.mark("retire")
            prof.end(prefilled=bool(groups))
            self.stats.iteration_tokens.observe(self._step_tokens)
        except Exception as exc:  # a failed forward fails the batch, not the engine
            log.exception("engine step failed; failing the running requests")
            self._in_flight, self._in_flight_rows = None, []
            for seq in dict.fromkeys([*self.running, *admitted]):
                if not seq.finished:
                    self.reject(seq, exc)
            self.running = []

    # -- overlapped decode (module docstring) --------------------------------------------
    def settle(self) -> None:
        """Read the decode step in flight, record its tokens and retire the rows that finished."""
        launched, rows = self._in_flight, self._in_flight_rows
        if launched is None:
            return
        self._in_flight, self._in_flight_rows = None, []
        self._append(rows, launched.result())
        self._retire_finished()

    def _can_chain(self) -> bool:
        """The next step may be launched before the one in flight is read: every position fits
        the cache as it is (a cache that grows moves), prefills included when one is due."""
        cache = self.runner.cache
        if cache.capacity == cache.max_len:
            return True
        longest = max((s.cached_len for s in self.running if not s.finished), default=0)
        return longest + 2 <= cache.capacity and not self._would_admit()

    def _would_admit(self) -> bool:
        """Whether `_admit` would take a request now (it takes none while too few rows are free,
        nor when the first admissible request's samples do not all fit)."""
        if not self.waiting:
            return False
        free = self.max_num_seqs - sum(1 for s in self.running if not s.finished)
        if self.running and free < self.min_admit_batch and not self._waited_long_enough():
            return False
        first = next((i for i, seq in enumerate(self.waiting) if self._admissible(seq)), None)
        return first is not None and samples_from(self.waiting, first) <= free

    def _chain(self, launched: DecodeLaunch, launched_rows: list[Sequence], sources: list[int]) -> None:
        """Launch the next step before reading `launched`: running rows below len(sources)
        carry on from its picks (row i from its row sources[i], on the device), the rows after
        them were prefilled just now (their first token is on the host). Then read `launched`;
        its rows that finished there decoded one token too many, dropped when read next time."""
        prof = self.profile
        running = self.running
        carried = len(sources)
        if running and all(s.sampling.plain for s in running[carried:]):
            last = self.runner.cache.capacity - 1  # a carried row past it ends in the step in flight
            positions = ([min(s.cached_len + 1, last) for s in running[:carried]]
                         + [s.cached_len for s in running[carried:]])
            inputs = [-(src + 1) for src in sources] + [s.last_token for s in running[carried:]]
            prof.batch, prof.live = len(running), sum(positions) + len(running)
            self._in_flight = self.runner.launch_decode(inputs, positions, [s.sampling for s in running],
                                                        after=launched)
            self._in_flight_rows = list(running)
            self.overlapped_steps += 1
            prof.mark("decode")
            self._append(launched_rows, launched.result())
            prof.mark("append")
            return
        # a newcomer needs its logits on the host: this step is read first, the next one waited for
        self._append(launched_rows, launched.result())
        self._decode_now()

    def _decode_now(self) -> None:
        """Retire, decode the running rows (launched only, in overlap), retire what finished."""
        self._retire_finished()
        if self.running:
            self._decode()
        self._retire_finished()

    def _admit(self) -> list[Sequence]:
        """FIFO into free rows under the prefill token budget; paused-out requests stay queued."""
        admitted: list[Sequence] = []
        kept: deque[Sequence] = deque()
        budget = self.max_prefill_tokens
        free = self.max_num_seqs - len(self.running)
        if self.running and free < self.min_admit_batch and not self._waited_long_enough():
            return admitted
        while self.waiting:
            seq = self.waiting[0]
            if not self._admissible(seq):
                kept.append(self.waiting.popleft())
                continue
            size = len(seq.prompt_token_ids)
            count = samples_from(self.waiting, 0)
            if len(admitted) + count > free or (admitted and size > budget):
                break
            admitted.extend(self.waiting.popleft() for _ in range(count))
            budget -= size
        kept.extend(self.waiting)
        self.waiting = kept
        now = time.monotonic()
        for seq in admitted:
            self._queued_at.pop(seq, None)
            seq.scheduled_at = now
        return admitted

    def _waited_long_enough(self) -> bool:
        oldest = next((s for s in self.waiting if self._admissible(s)), None)
        return oldest is not None and (
            self._step_count - self._queued_at.get(oldest, 0) > self.max_admit_delay_steps)

    def _live_len(self) -> int:
        """Positions a growing cache must keep: one more while a step is in flight (it writes one)."""
        return max((s.cached_len for s in self.running), default=0) + int(self._in_flight is not None)

    def _prefill(self, group: list[Sequence], forks: dict[Sequence, list[Sequence]]) -> None:
        """Prefill `group` into the next free rows; each one's forks (the other samples of its
        request) get a copy of its cache row and sample from its logits."""
        runner = self.runner
        width = max(len(s.prompt_token_ids) for s in group)
        runner.ensure_capacity(width, live_rows=len(self.running), live_len=self._live_len())
        first_row = len(self.running)
        every = frozenset(i for i, s in enumerate(group) if s.params.prompt_logprobs is not None)
        offsets = self._reuse_prefixes(group, first_row, every)
        logits, full = self.runner.prefill_all([s.prompt_token_ids for s in group], first_row, every,
                                               offsets)
        computed = sum(len(s.prompt_token_ids) for s in group) - sum(offsets or ())
        self.prefill_tokens += computed
        self._step_tokens += computed
        self.running.extend(group)
        seqs, rows = list(group), list(range(len(group)))
        for i, leader in enumerate(group):
            if i in full:
                _set_prompt_logprobs(leader, full[i])
            followers = forks.get(leader)
            if not followers:
                continue
            start = len(self.running)
            runner.copy_rows(first_row + i, list(range(start, start + len(followers))),
                             len(leader.prompt_token_ids))
            self.running.extend(followers)
            self.forked_rows += len(followers)
            self.forked_prompt_tokens += len(leader.prompt_token_ids) * len(followers)
            for f in followers:
                f.cached_prompt_tokens = len(f.prompt_token_ids)  # copied, not computed
                if leader.prompt_logprobs is not None:
                    f.set_prompt_logprobs(leader.prompt_logprobs, leader.prompt_top_logprobs or [])
            seqs += followers
            rows += [i] * len(followers)
        if len(seqs) > len(group):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        self._append(seqs, sample(logits, [s.sampling for s in seqs]))

    def _reuse_prefixes(self, group: list[Sequence], first_row: int,
                        every: frozenset[int]) -> list[int] | None:
        """Copy each prompt's longest cached prefix into its row; how many positions each got
        (None without a prefix cache). A prompt whose logprobs are asked for is run whole."""
        if self.prefixes is None:
            return None
        offsets = []
        for i, seq in enumerate(group):
            hit = None if i in every else self.prefixes.match(seq.prompt_token_ids, self.weight_version)
            if hit is not None:
                self.runner.load_rows(hit.entry.kv, first_row + i, hit.length)  # type: ignore[arg-type]
                seq.cached_prompt_tokens = hit.length
            offsets.append(hit.length if hit is not None else 0)
        return offsets

    def _keep_prefixes(self, rows: list[int]) -> None:
        """Copy these finished rows' keys and values into the prefix cache (those computed by
        the weights now served only: a row refitted mid-request holds older keys)."""
        if self.prefixes is None or self.runner.cache.kv is None:
            return
        for row in rows:
            seq = self.running[row]
            if seq.finish_reason in ("stop", "length") and seq.output_ids and all(
                    v == self.weight_version for _, v in seq.weight_versions):
                n = seq.cached_len
                tokens = [*seq.prompt_token_ids, *seq.output_ids][:n]
                self.prefixes.put(tokens, self.runner.keep_rows(row, n), self.weight_version)

    def _decode(self) -> None:
        running = self.running
        positions = [s.cached_len for s in running]
        longest = max(positions)
        self.runner.ensure_capacity(longest + 1, live_rows=len(running), live_len=longest)
        prof = self.profile
        prof.batch, prof.live = len(running), sum(positions) + len(running)
        prof.mark("schedule")
        rows = [s.sampling for s in running]
        if self.overlap and all(r.plain for r in rows):  # its tokens are read by the next step
            self._in_flight = self.runner.launch_decode([s.last_token for s in running], positions, rows)
            self._in_flight_rows = list(running)
            prof.mark("decode")
            return
        picks = self.runner.decode_sample([s.last_token for s in running], positions, rows, prof)
        prof.mark("wait")
        self._append(running, picks)
        self.profile.mark("append")

    def _append(self, seqs: list[Sequence], picks: Sampled) -> None:
        """Record a batch of sampled tokens, all at one clock reading. Each token's latency is
        the time since its row's previous token; rows whose previous token came with the last
        batch (a decode step's usual case) share one observation (stats.py)."""
        tokens, logprobs, top = picks
        version, eos, detok, touched = self.weight_version, self.eos_ids, self.detokenizer, self._touched
        now, previous, inter_token = time.monotonic(), self._appended_at, self.stats.inter_token
        along = recorded = 0  # rows whose previous token came with the last batch; tokens recorded
        for i, (seq, token, logprob) in enumerate(zip(seqs, tokens, logprobs)):
            if seq.finished:  # ended at the step before (overlapped decode): one token too many
                continue
            last = seq.last_token_at
            if last == previous:
                along += 1
            elif last:
                inter_token.observe(now - last)
            recorded += 1
            seq.append(token, logprob, version, eos, detok, top[i] if top is not None else None, now)
            if not seq.fold or seq.finish_reason is not None:
                touched[seq] = None
        if along and previous:
            inter_token.observe(now - previous, along)
        self._appended_at = now
        self._step_tokens += recorded

    def _retire_finished(self, in_flight: bool = False) -> list[int]:
        """Remove finished rows, moving the last running row into each hole (descending order);
        the cache rows move in one batched copy. Returns each remaining row's row before. With a
        step `in_flight` its rows hold one more position (queued after it, the copy sees it)."""
        running = self.running
        if not any(s.finish_reason is not None for s in running):
            return list(range(len(running)))
        origin = {id(s): row for row, s in enumerate(running)}
        self._keep_prefixes([row for row, s in enumerate(running) if s.finish_reason is not None])
        for row in range(len(running) - 1, -1, -1):
            if running[row].finish_reason is None:
                continue
            self.stats.finished(running[row])
            last = len(running) - 1
            if row != last:
                running[row] = running[last]
            running.pop()
        before = [origin[id(s)] for s in running]
        moves = [(src, row) for row, src in enumerate(before) if src != row]
        if moves:
            length = max(running[dst].cached_len for _, dst in moves) + int(in_flight)
            self.runner.move_rows([m[0] for m in moves], [m[1] for m in moves], length)
        return before

    # -- sleep ---------------------------------------------------------------------------
    def sleep(self, level: int) -> int:
        """Abort everything in flight, free the KV cache and offload (1) or drop (2) weights.

        The CUDA graphs are dropped first, unless every address they hold stays put across the
        sleep (virtual KV cache and weight store, vmm.py): then their memory pool stays on the
        device while asleep and the wake needs no capture."""
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level!r}")
        t0 = time.perf_counter()
        self.abort(None)  # settles the step in flight first
        before = used_bytes(self.runner.device)
        t1 = time.perf_counter()
        keep = self.runner.free_for_sleep(level)
        if self.prefixes is not None:
            self.prefixes.clear()
        self.kv_asleep = True
        t2 = time.perf_counter()
        self.runner.release_memory(keep)
        t3 = time.perf_counter()
        self.last_sleep_freed_bytes = max(0, before - used_bytes(self.runner.device))
        self.last_sleep_kept_graphs = keep
        self.last_sleep_resident_bytes = device_resident_bytes(self.runner.device)
        self.last_sleep_mapped_bytes = self.runner.cache.mapped_bytes() + self.weights.mapped_bytes()
        ms = lambda a, b: round((b - a) * 1000, 2)  # noqa: E731
        self.last_sleep_phases_ms = {"abort": ms(t0, t1), "free": ms(t1, t2), "release": ms(t2, t3)}
        return self.last_sleep_freed_bytes

    def wake_up(self, tags: list[str] | None) -> None:
        tags = list(tags) if tags else list(SLEEP_TAGS)
        unknown = [t for t in tags if t not in SLEEP_TAGS]
        if unknown:
            raise InvalidRequestError(f"unknown wake-up tags {unknown}; use {list(SLEEP_TAGS)}")
        self.runner.wake(weights="weights" in tags and not self.weights.on_device,
                         kv_cache="kv_cache" in tags and self.kv_asleep)
        if "kv_cache" in tags:
            self.kv_asleep = False

    # -- weights -------------------------------------------------------------------------
    def apply_update(self, staging: WeightStaging) -> int:
        """Swap a validated update in between two steps; bump the version."""
        if not self.weights.on_device:
            raise EngineStateError("weights are asleep; wake_up(['weights']) before updating")
        self.settle()  # the step in flight used the old weights: its tokens are recorded as such
        self.runner.commit_update(staging)
        self.weight_version = staging.version
        if self.prefixes is not None:  # computed by the old weights
            self.prefixes.clear()
        return self.weight_version


def _set_prompt_logprobs(seq: Sequence, logits: torch.Tensor) -> None:
    """Prompt token j's raw logprob (j >= 1) from position j - 1's logits [L, V]; the first
    token has none (None, no alternatives)."""
    raw = torch.log_softmax(logits.float(), dim=-1)[:-1]
    target = torch.tensor(seq.prompt_token_ids[1:], device=raw.device, dtype=torch.long)
    values: list[float | None] = [None, *raw.gather(1, target[:, None])[:, 0].tolist()]
    k = seq.params.prompt_logprobs or 0
    top = top_alternatives(raw, k) if k > 0 and len(target) else [[] for _ in target.tolist()]
    seq.set_prompt_logprobs(values, [[], *top])
