"""The in-process engine interface that the HTTP server wraps.

The server (server.py) only ever talks to an engine through `EngineAPI`, so the embedded torch
engine and any other in-process engine are interchangeable there. (A real vLLM server is a
different *backend*: it is its own HTTP server speaking the same HTTP API; see backends.py.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from rlix.devices import DeviceMemory
    from rlix.weights.wire import Layout

PauseMode = Literal["abort", "wait", "keep"]
FinishReason = Literal["stop", "length", "abort"]

#: the most alternatives per token an engine computes (OpenAI's and vLLM's default cap)
MAX_TOP_LOGPROBS = 20

#: (token id, raw logprob) pairs, most likely first: one token position's alternatives
TopLogprobs = list[tuple[int, float]]


ConstraintKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]


@dataclass(frozen=True)
class OutputConstraint:
    """What a constrained request's output must match (vLLM's structured outputs), as the engine
    takes it: the server turns `response_format`, `structured_outputs` and forced tool calls into
    one of these; the engine compiles it against its tokenizer (constrained.py) and masks every
    sampled token to it. Frozen and hashable: compiled grammars are cached by it.

    `spec`: the JSON schema (JSON text) for "json", the regex, the EBNF grammar, or xgrammar's
    structural tag (JSON text); empty for "json_object" (any JSON object) and "choice"
    (`choices`: the output is exactly one of them). `any_whitespace` False: JSON without
    whitespace between tokens (vLLM's disable_any_whitespace). `param` names the request field
    it came from, so that a schema that does not compile is a 400 naming that field."""

    kind: ConstraintKind
    spec: str = ""
    choices: tuple[str, ...] = ()
    any_whitespace: bool = True
    param: str = "structured_outputs"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. top_k <= 0 and top_p >= 1 disable those filters; temperature 0 is greedy.

    `n` samples of one prompt share its prefill (one forward; the prompt's cache row is copied);
    sample i draws from `seed + i` when seeded. `top_logprobs`: the k most likely tokens at each
    output position, with their raw logprobs; `prompt_logprobs` (None: not computed) does the same
    for the prompt's tokens, from the prefill. The penalties and `logit_bias` change what is
    sampled, before temperature / top-k / top-p, never the reported logprobs: presence and
    frequency count the generated tokens (OpenAI's), repetition (vLLM's) divides positive / multiplies
    negative logits of every token seen in the prompt or the output. `min_tokens` (vLLM's): until
    that many tokens were generated, the end-of-sequence ids and `stop_token_ids` are masked out
    of the sampled distribution (whether or not `ignore_eos`, as vLLM masks them) and no stop
    string can end the output (one ending in the text of the first `min_tokens` tokens is not a
    match). `constraint` (None: free text): every sampled token is one its grammar allows, and
    the output ends (finish "stop") once the grammar is complete and end-of-sequence sampled.
    `already_generated` (a re-dispatched continuation's): the prompt's last that many tokens are
    output an earlier attempt of the request generated under `constraint`, so the grammar's
    matcher starts after them (constrained.grammar_after) rather than at its start; without a
    constraint it changes nothing.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = True
    n: int = 1
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0
    constraint: OutputConstraint | None = None
    already_generated: int = 0

    @property
    def shapes_logits(self) -> bool:
        """True when a penalty or a bias must be applied before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0)


@dataclass
class GenerationOutput:
    """The state of one request, cumulative: every yield carries all tokens so far.

    `weight_versions` lists (start index into token_ids, weight version) spans, so a caller
    knows exactly which weights sampled each token. `stop_reason` says what ended a "stop"
    finish: the stop string or the stop token id (None for end-of-sequence), as vLLM reports it;
    token_ids keep every sampled token (a matched stop string's tokens included), so a text
    front end truncates the decoded text at that string. `first_token_at` times the first token
    (the server's time-to-first-token metric).

    With `n` > 1 one request yields the outputs of its `n` samples, each cumulative, told apart
    by `index`; `request_id` is then the sample's own (`<id>-<index>`), and `abort` takes either.
    `top_logprobs[i]` holds output token i's alternatives (when asked for); `prompt_logprobs` and
    `prompt_top_logprobs` the prompt's, the first token's None / [] (nothing precedes it).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    weight_versions: list[tuple[int, int]] = field(default_factory=list)
    stop_reason: int | str | None = None
    #: when its first token was sampled (time.monotonic() of the engine's process), None before
    first_token_at: float | None = None
    index: int = 0
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@runtime_checkable
class EngineAPI(Protocol):
    """What the engine server needs from an in-process engine. All methods are async-safe."""

    max_model_len: int
    weight_version: int
    device: torch.device  # where it computes: its memory is what a sleep must free

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 *, final_only: bool = False) -> AsyncIterator[GenerationOutput]:
        """Cumulative outputs, the last with finish_reason; `final_only`: just that one (per
        sample, when `params.n` > 1)."""
        ...

    async def abort(self, request_ids: list[str] | None = None) -> int: ...

    async def pause(self, mode: PauseMode) -> None: ...

    async def resume(self) -> None: ...

    def is_paused(self) -> bool: ...

    async def sleep(self, level: int) -> None: ...

    async def wake_up(self, tags: list[str] | None = None) -> None: ...

    def is_sleeping(self) -> bool: ...

    def failure(self) -> str | None: ...

    def device_memory(self) -> DeviceMemory: ...

    def num_running(self) -> int: ...

    def num_waiting(self) -> int: ...

    async def start_weight_update(self, version: int) -> None: ...

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None: ...

    async def finish_weight_update(self) -> int: ...

    # what it can do for a weight receiver (rlix.weights.api.WeightTarget says what each means)
    async def weight_checksums(self) -> dict[str, int]: ...

    def weight_specs(self) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None: ...

    def weight_destination(self, name: str) -> torch.Tensor | None: ...

    def adopt_layout(self, layout: Layout) -> bool: ...

    def weight_bucket(self, index: int) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]] | None: ...

    async def abort_weight_update(self, reason: str) -> None: ...


class Detokenizer(Protocol):
    """What the engine needs of a tokenizer to apply stop strings (transformers' tokenizers are)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...
