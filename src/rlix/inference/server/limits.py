"""Bounds on every request the engine server and the router accept, in one place.

Why: a request must cost bounded work before it is refused. A field checked only where it is
used is checked after the work it bounds: an `n` checked by the engine comes after the server
built n per-sample objects (a huge `n` then holds a shard's event loop, and its /health), and an
unbounded list (stop strings, token ids, messages, tools, logit_bias...) costs time in proportion
to its length before anything looks at it. These
bounds are generous for any real request (a few times the largest contexts and batches served)
and are checked where the body is parsed:

- the engine server: pydantic field constraints (openai_schema.py, control_schema.py) built from
  the constants below, which pydantic-core checks before it expands anything (a too-long list is
  refused before its items are validated): 400 naming the field;
- the router, which relays JSON without parsing it into models: `check_bounds` over the same
  table (`FIELD_BOUNDS`), before anything is relayed or any per-sample state exists: 400 naming
  the field.

Body sizes and JSON nesting are bounded before either, by rlix.httpkit.RequestGuard (the sizes
of the engine's control and weight paths are below; the data plane's is httpkit's
MAX_BODY_BYTES, `--max-body-mib`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BeforeValidator

from rlix.errors import InvalidRequestError
from rlix.inference.server.paths import CHAT, COMPLETIONS, GENERATE, RESPONSES

# ---------------------------------------------------------------- request fields
#: samples of one request (`n`, `best_of`); an engine refuses more than its max_num_seqs itself
MAX_N = 1024
#: `max_tokens` and its aliases: more than any model's context (the context left caps it anyway)
MAX_TOKENS = 2**24
#: token ids of one prompt (`token_ids`, `prompt` ids, /detokenize `tokens`)
MAX_PROMPT_TOKENS = 2**18
#: characters of one prompt string (tokenizing 1 MiB of text takes about a second of CPU)
MAX_PROMPT_CHARS = 2**20
#: prompts of one completions request (vLLM's batch form; its default VLLM_MAX_COMPLETION_PROMPTS)
MAX_PROMPTS = 1024
#: chat `messages` (and /v1/responses `input` items)
MAX_MESSAGES = 4096
#: chat `tools` (OpenAI allows 128)
MAX_TOOLS = 256
#: `stop` strings, and the characters of each
MAX_STOP = 64
MAX_STOP_CHARS = 1024
#: `stop_token_ids`
MAX_STOP_TOKEN_IDS = 1024
#: `logit_bias` entries (OpenAI allows 300)
MAX_LOGIT_BIAS = 1024
#: a constraint's text: a JSON schema (as JSON), a regex, a grammar, a structural tag. Compiling
#: costs about linear time in it (a regex can cost more: its size is what bounds it here)
MAX_CONSTRAINT_CHARS = 2**16
#: a structural tag's text: it holds one schema per tag (a forced tool call's: one per tool, each
#: bounded as above), so several constraints' worth; the router continues a forced call as one
MAX_STRUCTURAL_TAG_CHARS = 4 * MAX_CONSTRAINT_CHARS
#: `structured_outputs.choice` entries, and the characters of each
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
#: `top_k` (more than any vocabulary: the engine treats k >= vocabulary as no filter)
MAX_TOP_K = 2**31 - 1
#: `seed`: torch's long, as vLLM bounds it
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
#: identifiers and names: `request_id`, `model` (a model may be named by its path), tool names...
MAX_ID_CHARS = 4096
#: keys of small free-form objects (`chat_template_kwargs`, `metadata`, a transfer's details)
MAX_KEYS = 64
#: `include` values of one Responses request (the API knows six)
MAX_INCLUDES = 16
#: request ids one /abort_requests names
MAX_ABORT_IDS = 16384
#: bucket messages of one /sync_weights (a bucket is tens to hundreds of MB)
MAX_BUCKETS = 2**16

# ---------------------------------------------------------------- bodies (the engine's control plane)
#: /init_weight_transfer_engine and /sync_weights: a bucket layout (~80 bytes a tensor: a MoE
#: model of 20k tensors is ~1.6 MB) or every bucket's transport message
MAX_TRANSFER_BODY_BYTES = 16 * 2**20
#: /update_weights when the engine cannot say how large its weights are (else: see
#: `weights_body_limit`): the safetensors body of simple callers and small models
MAX_WEIGHTS_BODY_BYTES = 16 * 2**30


def weights_body_limit(engine: Any) -> int:
    """The body bound of /update_weights for this engine: its parameters at 4 bytes each (a
    float32 trainer's tensors for a bf16 engine), base64's 4/3 (the JSON form), plus 16 MiB for
    names and headers. A larger body cannot be an update of this model. `MAX_WEIGHTS_BODY_BYTES`
    when the engine cannot tell (`weight_specs`)."""
    specs = getattr(engine, "weight_specs", None)
    if not callable(specs):
        return MAX_WEIGHTS_BODY_BYTES
    try:
        numel = 0
        for shape, _ in specs().values():
            n = 1
            for d in shape:
                n *= int(d)
            numel += n
    except Exception:  # noqa: BLE001 - a test double or an engine without specs: the default
        return MAX_WEIGHTS_BODY_BYTES
    return numel * 4 * 4 // 3 + 16 * 2**20


def at_most(entries: int) -> BeforeValidator:
    """A pydantic annotation: an object (or list) of more than `entries` entries is refused
    before any entry is validated (pydantic's own max_length on a dict counts only after
    validating every entry: 300,000 bad entries cost 1.5 s and 300,000 errors)."""
    def check(value: Any) -> Any:
        if isinstance(value, (dict, list)) and len(value) > entries:
            raise ValueError(f"{len(value)} entries; at most {entries} are accepted")
        return value

    return BeforeValidator(check)


# ---------------------------------------------------------------- the router's check
@dataclass(frozen=True)
class Bound:
    """What one field may hold; a value of another type is left to the field's own validation."""

    most: int | None = None  # a number's largest value
    least: int | None = None  # a number's smallest value
    items: int | None = None  # a list's or an object's most entries
    chars: int | None = None  # a string's most characters (the value's, or each string item's)
    item_items: int | None = None  # each list item's most entries (a batch of token-id prompts)

    def check(self, name: str, value: Any) -> None:
        """InvalidRequestError naming `name` if `value` is out of bounds; cost bounded by `items`."""
        if isinstance(value, bool):
            return
        if isinstance(value, (int, float)):
            if self.most is not None and value > self.most:
                raise InvalidRequestError(f"{name} must be at most {self.most}, got {_short(value)}", param=name)
            if self.least is not None and value < self.least:
                raise InvalidRequestError(f"{name} must be at least {self.least}, got {_short(value)}", param=name)
        elif isinstance(value, str):
            if self.chars is not None and len(value) > self.chars:
                raise InvalidRequestError(f"{name} holds {len(value)} characters; at most {self.chars} "
                                          f"are accepted", param=name)
        elif isinstance(value, (list, dict)):
            if self.items is not None and len(value) > self.items:
                raise InvalidRequestError(f"{name} holds {len(value)} entries; at most {self.items} "
                                          f"are accepted", param=name)
            if isinstance(value, list) and value and isinstance(value[0], (str, list)):
                for i, item in enumerate(value):
                    if isinstance(item, str) and self.chars is not None and len(item) > self.chars:
                        raise InvalidRequestError(f"{name}[{i}] holds {len(item)} characters; at most "
                                                  f"{self.chars} are accepted", param=name)
                    if isinstance(item, list) and self.item_items is not None and len(item) > self.item_items:
                        raise InvalidRequestError(f"{name}[{i}] holds {len(item)} entries; at most "
                                                  f"{self.item_items} are accepted", param=name)


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"


#: sampling fields, top-level in completions and chat, under `sampling_params` in generate
SAMPLING_BOUNDS: dict[str, Bound] = {
    "structured_outputs": Bound(items=MAX_KEYS), "response_format": Bound(items=MAX_KEYS),
    "n": Bound(most=MAX_N), "best_of": Bound(most=MAX_N),
    "max_tokens": Bound(most=MAX_TOKENS), "max_completion_tokens": Bound(most=MAX_TOKENS),
    "stop": Bound(items=MAX_STOP, chars=MAX_STOP_CHARS),
    "stop_token_ids": Bound(items=MAX_STOP_TOKEN_IDS),
    "logit_bias": Bound(items=MAX_LOGIT_BIAS),
    "top_k": Bound(most=MAX_TOP_K),
    "seed": Bound(most=MAX_SEED, least=MIN_SEED),
}
#: the fields of each data-plane path the router checks (the engine's models carry the same bounds)
FIELD_BOUNDS: dict[str, dict[str, Bound]] = {
    COMPLETIONS: {**SAMPLING_BOUNDS, "model": Bound(chars=MAX_ID_CHARS),
                  "already_generated": Bound(most=MAX_PROMPT_TOKENS, least=0),
                  "prompt": Bound(items=MAX_PROMPT_TOKENS, chars=MAX_PROMPT_CHARS,
                                  item_items=MAX_PROMPT_TOKENS)},
    CHAT: {**SAMPLING_BOUNDS, "model": Bound(chars=MAX_ID_CHARS), "messages": Bound(items=MAX_MESSAGES),
           "tools": Bound(items=MAX_TOOLS), "chat_template_kwargs": Bound(items=MAX_KEYS)},
    GENERATE: {"token_ids": Bound(items=MAX_PROMPT_TOKENS), "request_id": Bound(chars=MAX_ID_CHARS),
               "model": Bound(chars=MAX_ID_CHARS), "already_generated": Bound(most=MAX_PROMPT_TOKENS, least=0)},
    RESPONSES: {**SAMPLING_BOUNDS, "max_output_tokens": Bound(most=MAX_TOKENS),
                "model": Bound(chars=MAX_ID_CHARS), "input": Bound(items=MAX_MESSAGES, chars=MAX_PROMPT_CHARS),
                "instructions": Bound(chars=MAX_PROMPT_CHARS), "tools": Bound(items=MAX_TOOLS),
                "previous_response_id": Bound(chars=MAX_ID_CHARS), "request_id": Bound(chars=MAX_ID_CHARS),
                "session_id": Bound(chars=MAX_ID_CHARS), "include": Bound(items=MAX_INCLUDES),
                "metadata": Bound(items=MAX_KEYS), "chat_template_kwargs": Bound(items=MAX_KEYS),
                "max_tool_calls": Bound(most=MAX_TOKENS)},
}


def check_bounds(path: str, body: Mapping[str, Any]) -> None:
    """InvalidRequestError (400) naming the first field of a data-plane request body that is out
    of bounds; for the router, which does not parse bodies into models. A few dict lookups."""
    bounds = FIELD_BOUNDS.get(path)
    if bounds is None:
        return
    for name, bound in bounds.items():
        value = body.get(name)
        if value is not None:
            bound.check(name, value)
    if path == GENERATE:
        params = body.get("sampling_params")
        if isinstance(params, dict):
            for name, bound in SAMPLING_BOUNDS.items():
                value = params.get(name)
                if value is not None:
                    bound.check(f"sampling_params.{name}", value)
