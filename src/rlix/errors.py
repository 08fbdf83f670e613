"""Typed errors raised at rlix's boundaries.

Every error a user can cause derives from `RlixError`, so the CLI can print it as one line
instead of a traceback.
"""

from __future__ import annotations

import re
import reprlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class RlixError(Exception):
    """Base class for every error rlix raises on purpose."""


class ConfigError(RlixError):
    """A configuration file or value is invalid; the message names the file and the field."""


class LedgerError(RlixError):
    """A change to the GPU ledger would break one of its invariants; the ledger is unchanged."""


class SchedulerError(RlixError):
    """A scheduler call is invalid (unknown pipeline, duplicate request, impossible size...)."""


class UnknownPipelineError(SchedulerError):
    """The named pipeline is not registered with the scheduler."""


class SchedulerStateError(SchedulerError):
    """The scheduler's persisted state cannot be read back after a restart (unreadable, another
    format or another cluster's); the restarted scheduler refuses calls rather than start empty."""


class ScenarioError(ConfigError):
    """A simulator scenario file is invalid."""


class InferenceError(RlixError):
    """Base for inference-layer errors."""


class InvalidRequestError(InferenceError):
    """A generation request is malformed or impossible (the server answers 4xx).

    `param` names the offending request field, as OpenAI/vLLM error bodies do.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve (HTTP 404)."""


class ResponseNotFoundError(InvalidRequestError):
    """A Responses request names a response this server does not hold (HTTP 404, as vLLM's):
    never stored (`store: false`), evicted from the bounded store, or unknown."""


class UpstreamAnswerError(InferenceError):
    """A shard refused a request the router translated (a Responses request relayed as a chat
    completion): its status and error body, to be passed on to the caller as they came."""

    def __init__(self, status: int, body: dict) -> None:
        error = body.get("error") if isinstance(body, dict) else None
        super().__init__(str(error.get("message") if isinstance(error, dict) else body)[:500])
        self.status, self.body = status, body
        self.param = error.get("param") if isinstance(error, dict) else None


class EngineStateError(InferenceError):
    """The engine cannot do this now: asleep, weights not loaded, paused in a conflicting mode."""


class WeightUpdateError(InferenceError):
    """A weight update was refused or failed; the old weights keep serving."""


class ShardPreemptedError(InferenceError):
    """A shard was preempted while serving a request; the router re-dispatches it elsewhere."""


class NoActiveShardError(InferenceError):
    """No shard became active within the router's hold timeout."""


class WeightLayoutError(WeightUpdateError):
    """The sender's bucket layout does not fit the receiving model (unknown name, other shape or
    dtype, or a different layout than the one agreed); refused before any bytes are applied."""


class WeightChecksumError(WeightUpdateError):
    """A bucket's bytes do not match the sender's checksum (verification on)."""


class WeightTransferError(WeightUpdateError):
    """The transfer itself failed: the peer died, the connection dropped, a transport failed or
    timed out, or buckets are missing at finish. The old weights keep serving."""


class WeightSyncError(WeightUpdateError):
    """A selective sync did not reach every shard it targeted; `failed` maps each failed DP rank
    to its reason and `succeeded` lists the ranks that did move to the new version."""

    def __init__(self, message: str, failed: dict[int, str], succeeded: list[int]) -> None:
        super().__init__(message)
        self.failed = failed
        self.succeeded = succeeded


class WeightCacheError(RlixError):
    """The CPU weight cache cannot do this: unknown version, or its slot is in use."""


class HostMemoryError(WeightCacheError):
    """The weight cache would not fit in the host's free memory; the message has the numbers."""


class TrainingError(RlixError, ValueError):
    """A training call got bad input (empty batch, mismatched lengths or shapes, a data-parallel
    group that does not match the trainer) or cannot run in the trainer's current state."""


class AccountingError(RlixError):
    """Trajectories went missing: started != trained + dropped + buffered + in flight."""


class TaskError(RlixError):
    """A task could not score a response: its verifier raised or returned a non-number."""


class CollectorError(RlixError):
    """The trajectory collector stopped (or died) while the training loop waited on it."""


class GpuMemoryError(RlixError):
    """A GPU hand-off failed: a holder did not free its memory, or the next holder found too
    little free (or ran out). The message names the GPU and the holder."""


class VirtualMemoryError(GpuMemoryError):
    """A CUDA virtual memory call failed: `call` names it and `code` is its CUresult (None for a
    check of rlix's own, such as torch copying a buffer instead of viewing it)."""

    def __init__(self, message: str, call: str | None = None, code: int | None = None) -> None:
        super().__init__(message)
        self.call, self.code = call, code


class ShardDiedError(InferenceError):
    """A shard's server process kept dying (each death is replaced until a limit)."""


class PipelineStalledError(CollectorError):
    """Every group failed (reward or generation) max_failed_groups times in a row."""


class TrainerDiedError(RlixError):
    """A pipeline's trainer actor (its process) died."""


class PipelineHungError(RlixError):
    """A pipeline's actor stopped answering within its heartbeat timeout."""


class NodeLostError(RlixError):
    """A Ray node of the run died (its raylet exited, or its machine left the cluster) and took
    every pipeline it ran: the run ends with this reason, not with each actor's death."""


class PipelineFailedError(RlixError):
    """Every pipeline of a run failed (each one's error is in the message)."""


class AgentEnvError(RlixError):
    """An agent environment (its agent or resources server) failed: it would not start, kept
    dying past its restart limit, or gave an answer that is not what the protocol says."""


class EpisodeError(AgentEnvError):
    """One episode failed: `env` and `episode` name where; `reason` is what the accounting records.
    Retried or counted; never a pipeline crash."""

    def __init__(self, env: str, episode: str, reason: str) -> None:
        super().__init__(f"environment {env}, episode {episode}: {reason}")
        self.env, self.episode, self.reason = env, episode, reason


#: the longest one-line error a config check prints (file, field and reason; inputs shortened)
MAX_MESSAGE = 500


def short_repr(value: object, limit: int = 80) -> str:
    """`repr(value)` at most `limit` characters, at a cost bounded by the limit too (a huge
    list or string is never repr'd whole: reprlib walks only what it shows)."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = limit
    r.maxlist = r.maxtuple = r.maxset = r.maxdict = 6
    r.maxlevel = 3
    text = r.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def problems_line(source: str, problems: list[str], limit: int = MAX_MESSAGE) -> str:
    """`source: problem; problem; ...` as one line of at most `limit` characters: whole
    problems while they fit (the first one always, shortened if it must be), then how many
    were left out."""
    problems = [" ".join(p.split()) for p in problems] or ["invalid"]
    line, shown = f"{source}: {problems[0]}", 1
    for i, problem in enumerate(problems[1:], 1):
        room = limit - (0 if i == len(problems) - 1 else 24)  # 24: " (and N more problems)"
        if len(line) + 2 + len(problem) > room:
            break
        line, shown = f"{line}; {problem}", shown + 1
    left = len(problems) - shown
    tail = f" (and {left} more problem{'s' if left > 1 else ''})" if left else ""
    if len(line) + len(tail) > limit:
        line = line[: max(limit - len(tail) - 3, 0)] + "..."
    return line + tail


def format_validation_error(source: str, err: ValidationError) -> str:
    """`file: field.path: reason (got value)` for each problem, joined on one line of at most
    MAX_MESSAGE characters (each value shortened)."""
    parts = []
    for e in err.errors(include_url=False):
        loc = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in e["loc"]).replace(".[", "[")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling)"
        elif "input" in e and e["type"] != "missing" and not isinstance(e["input"], dict):
            msg = f"{msg} (got {short_repr(e['input'])})"
        parts.append(f"{loc[:120] or '<top>'}: {msg[:300]}")
    return problems_line(source, parts)


def actor_death(exc: BaseException) -> str:
    """Why a Ray actor's process died, in a few words: Ray's exit type and the first sentence of
    its detail (its message goes on with a list of possible causes that would bury them)."""
    text = " ".join(str(getattr(exc, "cause", None) or exc).split())
    kind = re.search(r"Worker exit type: (\S+)", text)
    detail = re.search(r"Worker exit detail: (.+?\.)(?:\s|$)", text)
    if kind is None:
        return text.split(". ")[0][:200]
    return kind.group(1) + (f" ({detail.group(1)[:200]})" if detail else "")


def one_line(exc: BaseException) -> str:
    """An error as one line: Ray's wrapping and tracebacks dropped, the cause's type and last
    meaningful line kept (what `rlix run` prints for a failed pipeline)."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    last = next((line for line in reversed(text) if line.strip()), "") if text else ""
    return f"{type(cause).__name__}: {last.strip()}"[:500]


class ClientError(RlixError):
    """A call of rlix.client was refused; the pipeline and its weights are as they were."""


class ClientOrderError(ClientError):
    """A client call out of the hooks' order (after_training before before_training, a step
    that is not the next, a second start); the message says which call was expected."""


class PipelineEndedError(ClientError):
    """The pipeline the client drives has ended or failed (its reason in the message)."""

