"""Batched token sampling whose result for a row never depends on the other rows.

Every request owns a random stream (Python's Mersenne Twister, seeded with the request's seed
or with fresh OS entropy) and draws exactly one uniform number per sampled token. The token is
then picked by inverse CDF over the row's filtered distribution (temperature, then top-k, then
top-p). So a seeded request yields the same tokens alone, in any batch, after a pause, and on any
device, up to float rounding of the logits; and the whole batch is sampled with a few tensor ops
instead of one torch.Generator call per row.

Before that, a row that asked for them gets its logits shaped (`LogitShaping`): `logit_bias`
added, then vLLM's repetition penalty (tokens of the prompt or the output: positive logits
divided, negative ones multiplied), then OpenAI's frequency and presence penalties (the output's
token counts). A row short of its `min_tokens` has its stop ids (end-of-sequence and
`stop_token_ids`) set to -inf, as vLLM's min-tokens logits processor does, until the row has
generated that many tokens; only then does it become plain again (sampled inside the decode CUDA
graph, overlapped). A constrained row (structured outputs, forced tool calls) then has every token
its grammar forbids set to -inf (constrained.py); were its min_tokens mask to forbid what the
grammar still allows, the grammar wins (an output that can only end must end). Rows that did not
ask cost nothing: the batch's logits are not even copied.

Logprobs are those of the model's raw distribution: log_softmax of the unscaled, unfiltered,
unshaped logits, evaluated at the sampled token (what a trainer recomputes from the same
weights); a row's `top_logprobs` alternatives are the k most likely tokens of that same
distribution.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from rlix.inference.engine.api import TopLogprobs
from rlix.inference.engine.constrained import RowGrammar, apply_grammars


def new_rng(seed: int | None) -> random.Random:
    """The per-request random stream (fresh entropy when unseeded)."""
    return random.Random(seed if seed is not None else random.SystemRandom().getrandbits(64))


@dataclass
class LogitShaping:
    """One row's penalties and bias, and the token counts they need (on the logits' device,
    allocated at the row's first step)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: tuple[tuple[int, float], ...] = ()
    prompt_ids: list[int] = field(default_factory=list)  # read only for the repetition penalty
    counts: torch.Tensor | None = None  # [V] output token counts
    seen_in_prompt: torch.Tensor | None = None  # [V] bool
    _bias: tuple[torch.Tensor, torch.Tensor] | None = None

    def _setup(self, row: torch.Tensor) -> None:
        vocab, device = row.shape[0], row.device
        self.counts = torch.zeros(vocab, dtype=row.dtype, device=device)
        if self.repetition != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            ids = [t for t in self.prompt_ids if 0 <= t < vocab]
            if ids:
                seen[torch.tensor(ids, device=device)] = True
            self.seen_in_prompt = seen
        if self.bias:
            self._bias = (torch.tensor([t for t, _ in self.bias], device=device),
                          torch.tensor([b for _, b in self.bias], dtype=row.dtype, device=device))

    def apply(self, row: torch.Tensor) -> None:
        """Shape one row of logits [V] in place."""
        if self.counts is None:
            self._setup(row)
        assert self.counts is not None
        if self._bias is not None:
            row.index_add_(0, *self._bias)
        if self.repetition != 1.0:
            assert self.seen_in_prompt is not None
            seen = self.seen_in_prompt | (self.counts > 0)
            shaped = torch.where(row > 0, row / self.repetition, row * self.repetition)
            row.copy_(torch.where(seen, shaped, row))
        if self.frequency:
            row.sub_(self.counts * self.frequency)
        if self.presence:
            row.sub_((self.counts > 0).to(row.dtype) * self.presence)

    def observe(self, token: int) -> None:
        """Count a token this row sampled."""
        if self.counts is not None:
            self.counts[token] += 1


@dataclass
class RowSampling:
    """The sampling settings of one running row."""

    temperature: float
    top_k: int
    top_p: float
    rng: random.Random
    top_logprobs: int = 0  # alternatives to report per token (0: none)
    shaping: LogitShaping | None = None
    #: token ids masked out (-inf) while the row is short of its min_tokens; None: no mask
    held: tuple[int, ...] | None = None
    #: the row's grammar matcher (a constrained request); None: free text
    grammar: RowGrammar | None = None
    #: temperature (or greedy) only: sampled by `sample_plain`, inside a decode CUDA graph
    plain: bool = field(init=False)
    _held_ids: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._set_plain()

    def _set_plain(self) -> None:
        self.plain = (self.shaping is None and not self.top_logprobs and self.top_k <= 0
                      and self.top_p >= 1.0 and self.held is None and self.grammar is None)

    def hold(self, ids: tuple[int, ...]) -> None:
        """Mask `ids` out of this row's distribution until `release` (min_tokens). The row is
        not plain meanwhile: its logits come to `sample`, which applies the mask."""
        self.held, self._held_ids = ids, None
        self._set_plain()

    def release(self) -> None:
        """Stop masking (the row has its min_tokens): plain again if nothing else shapes it."""
        self.held, self._held_ids = None, None
        self._set_plain()

    def mask_held(self, row: torch.Tensor) -> None:
        """Set the held ids' logits of one row [V] to -inf, in place (ids past the vocabulary:
        nothing to mask; the index tensor is made once per row and device)."""
        if self._held_ids is None or self._held_ids.device != row.device:
            vocab = row.shape[0]
            self._held_ids = torch.tensor([t for t in self.held or () if 0 <= t < vocab],
                                          dtype=torch.long, device=row.device)
        row.index_fill_(0, self._held_ids, float("-inf"))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def plain_inputs(rows: list[RowSampling]) -> tuple[list[float], list[float]]:
    """The uniforms (one draw per sampled row, none for greedy rows: 0.5 stands in) and the
    temperatures (0: greedy) that `sample_plain` takes."""
    return ([0.5 if r.temperature <= 0.0 else max(r.rng.random(), 1e-12) for r in rows],
            [max(r.temperature, 0.0) for r in rows])


def sample_plain(logits: torch.Tensor, uniforms: torch.Tensor, temperatures: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and raw logprobs for rows that use temperature only (0: greedy), on the device
    and without a host sync (it runs inside the decode graph): the same picks as `sample`."""
    logits = logits.float()
    greedy = temperatures <= 0.0
    temps = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    sampled = _inverse_cdf(torch.softmax(logits / temps[:, None], dim=-1), uniforms)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    raw = torch.log_softmax(logits, dim=-1)
    return tokens, raw.gather(1, tokens[:, None])[:, 0]


class Sampled(NamedTuple):
    """One step's picks: token ids, their raw logprobs, and each row's alternatives (None for
    the rows that asked for none; `top` itself is None when no row did)."""

    tokens: list[int]
    logprobs: list[float]
    top: list[TopLogprobs | None] | None = None


def sample(logits: torch.Tensor, rows: list[RowSampling]) -> Sampled:
    """Pick one token per row of `logits` [B, V]; return the picks and their raw logprobs."""
    if all(r.plain for r in rows):
        uniforms, temps = plain_inputs(rows)
        device = logits.device
        tokens, logprobs = sample_plain(logits, torch.tensor(uniforms, device=device),
                                        torch.tensor(temps, device=device))
        picked, values = torch.stack((tokens.double(), logprobs.double())).tolist()
        return Sampled([int(t) for t in picked], values)
    logits = logits.float()
    batch, vocab = logits.shape
    device = logits.device
    shaped = logits
    # rows that asked for shaping, a min_tokens mask, a grammar or alternatives (usually none)
    special = [i for i, r in enumerate(rows)
               if r.shaping is not None or r.top_logprobs or r.held is not None or r.grammar is not None]
    shaping = [i for i in special
               if rows[i].shaping is not None or rows[i].held is not None or rows[i].grammar is not None]
    if shaping:
        shaped = logits.clone()
        for i in shaping:
            if rows[i].shaping is not None:
                rows[i].shaping.apply(shaped[i])  # type: ignore[union-attr]
        constrained = [i for i in shaping if rows[i].grammar is not None]
        if constrained:
            apply_grammars(shaped, constrained, [rows[i].grammar for i in constrained])  # type: ignore[misc]
        for i in shaping:
            row = rows[i]
            if row.held is None:
                continue
            if row.grammar is None:
                row.mask_held(shaped[i])
                continue
            held = shaped[i].clone()
            row.mask_held(held)
            if bool(torch.isfinite(held).any()):  # else the grammar allows nothing but an end
                shaped[i] = held
    greedy = [r.temperature <= 0.0 for r in rows]  # (the property costs 1.5 us per 32 rows)
    tokens = shaped.argmax(dim=-1)
    if not all(greedy):
        # Only sampled rows draw, one number per token, whatever their neighbours do.
        uniforms = torch.tensor([0.5 if g else max(r.rng.random(), 1e-12)
                                 for g, r in zip(greedy, rows)], device=device)
        temps = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in rows],
                             device=device)
        scaled = shaped / temps[:, None]
        use_top_k = any(0 < r.top_k < vocab for r in rows)
        use_top_p = any(r.top_p < 1.0 for r in rows)
        if use_top_k or use_top_p:
            sampled = _sample_filtered(scaled, rows, uniforms, use_top_k, use_top_p)
        else:
            probs = torch.softmax(scaled, dim=-1)
            sampled = _inverse_cdf(probs, uniforms)
        greedy_mask = torch.tensor(greedy, device=device)
        tokens = torch.where(greedy_mask, tokens, sampled)
    raw = torch.log_softmax(logits, dim=-1)
    logprobs = raw.gather(1, tokens[:, None])[:, 0]
    picked: list[int] = tokens.tolist()
    if not special:
        return Sampled(picked, logprobs.tolist())
    for i in shaping:
        if rows[i].shaping is not None:
            rows[i].shaping.observe(picked[i])  # type: ignore[union-attr]
    wanted = [i for i in special if rows[i].top_logprobs > 0]
    return Sampled(picked, logprobs.tolist(), _alternatives(raw, rows, wanted) if wanted else None)


def top_alternatives(raw: torch.Tensor, k: int) -> list[TopLogprobs]:
    """The k most likely (token id, logprob) of each row of raw logprobs [R, V], best first."""
    values, ids = raw.topk(min(k, raw.shape[-1]), dim=-1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def _alternatives(raw: torch.Tensor, rows: list[RowSampling], wanted: list[int]) -> list[TopLogprobs | None]:
    k = max(rows[i].top_logprobs for i in wanted)
    index = torch.tensor(wanted, device=raw.device)
    found = top_alternatives(raw.index_select(0, index), k)
    out: list[TopLogprobs | None] = [None] * len(rows)
    for i, alts in zip(wanted, found):
        out[i] = alts[: rows[i].top_logprobs]
    return out


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index of the first cumulative probability >= u * total (never a zero-probability entry)."""
    cdf = probs.cumsum(dim=-1)
    targets = uniforms * cdf[:, -1]
    index = (cdf < targets[:, None]).sum(dim=-1)
    return index.clamp_(max=probs.shape[-1] - 1)


def _sample_filtered(scaled: torch.Tensor, rows: list[RowSampling], uniforms: torch.Tensor,
                     use_top_k: bool, use_top_p: bool) -> torch.Tensor:
    """Top-k then top-p (on the top-k renormalised distribution), over logits sorted once."""
    device = scaled.device
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    if use_top_k:
        ks = torch.tensor([r.top_k if 0 < r.top_k < vocab else vocab for r in rows],
                          device=device)
        ranks = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    if use_top_p:
        ps = torch.tensor([r.top_p for r in rows], device=device)
        mass_before = probs.cumsum(dim=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p; the top token always stays.
        probs = probs.masked_fill(mass_before >= ps[:, None], 0.0)
    picked = _inverse_cdf(probs, uniforms)
    return order.gather(1, picked[:, None])[:, 0]
