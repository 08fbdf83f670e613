"""TRL's GRPOTrainer as an rlix pipeline, through TRL's own extension points (no fork of TRL).

    import rlix.client
    from rlix.client.trl import RlixTRL

    adapter = RlixTRL(rlix.client.connect())
    trainer = adapter.grpo_trainer(model=model, reward_funcs=[my_reward], args=GRPOConfig(...),
                                   train_dataset=dataset)
    trainer.train()

What it wires into the GRPOTrainer:
- `rollout_func` (TRL's hook for a custom generation backend): every prompt of the batch is
  tokenized as TRL would (its chat template for conversational prompts), `num_generations`
  completions of it are sampled by the pipeline's shards through rlix's router (TRL's sampling
  settings: temperature, top_p, top_k, repetition_penalty, max_completion_length), with the
  sampled tokens' logprobs; demand is reported as the batch fills; then before_training blocks
  until the training GPUs are the pipeline's.
- a TrainerCallback: on_train_begin publishes the policy's weights as version 0 (start); after
  each optimizer step (on_step_end) after_training publishes them as the next version and gives
  the GPUs back, with the step's mean reward (from `watch`-ed reward functions). On CUDA the
  model and TRL's optimizer state leave the GPU at each of those and come back at
  before_training (rlix.client's TrainingState): TRL touches neither between the step's end and
  the next rollout_func's return.
- `watch(reward_funcs)`: the reward functions, each wrapped to remember its last batch's scores.

TRL's server mode for vLLM is not used: its client needs vLLM importable in the trainer's process
and NCCL for weights; rlix's shards take the weights through its own weight path instead. The
adapter assumes one optimizer step per generation batch (TRL's default: steps_per_generation ==
gradient_accumulation_steps) and one process (no accelerate multi-process launch).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from transformers import TrainerCallback

from rlix.client.pipeline_client import PipelineClient
from rlix.errors import ClientError


class RlixTRL:
    """See module doc. `concurrency`: generate requests in flight at once (the router spreads
    them over the pipeline's shards); `timeout_s`: one request's limit (a request cut by a
    preemption is re-dispatched by the router within it)."""

    def __init__(self, client: PipelineClient, *, concurrency: int = 32, timeout_s: float = 600.0) -> None:
        self.client = client
        self.concurrency = concurrency
        self.http = httpx.Client(base_url=client.info.base_url, timeout=timeout_s,
                                 headers={"Authorization": f"Bearer {client.info.api_key}"})
        self.callback = _Hooks(self)
        self._scores: dict[str, list[float]] = {}  # reward function -> its scores of the last batch
        self._started = False

    def grpo_trainer(self, **kwargs: Any) -> Any:
        """A trl.GRPOTrainer made with these keyword arguments, and this adapter's rollout_func,
        callback and watched reward functions."""
        from trl import GRPOTrainer  # deferred: TRL is optional (pip install 'rlix[trl]')

        if kwargs.get("rollout_func") is not None:
            raise ClientError("RlixTRL.grpo_trainer: rollout_func is the adapter's (generation goes to rlix's shards)")
        args = kwargs.get("args")
        if args is not None and args.use_vllm:
            raise ClientError("RlixTRL.grpo_trainer: set use_vllm=False: rlix's shards generate")
        funcs = kwargs.pop("reward_funcs")
        callbacks = list(kwargs.pop("callbacks", None) or [])
        return GRPOTrainer(reward_funcs=self.watch(funcs if isinstance(funcs, list) else [funcs]),
                           rollout_func=self.rollout, callbacks=[*callbacks, self.callback], **kwargs)

    def watch(self, funcs: Sequence[Callable[..., list[float | None]]]) -> list[Callable[..., list[float | None]]]:
        """Each reward function, wrapped to keep its last batch's scores (the step's reward);
        the wrapper keeps the function's name (TRL logs each function's rewards under it)."""
        return [self._watched(fn, i) for i, fn in enumerate(funcs)]

    def _watched(self, fn: Callable[..., list[float | None]], i: int) -> Callable[..., list[float | None]]:
        key = f"{i}:{fn.__name__}"

        @functools.wraps(fn)
        def scored(*args: Any, **kwargs: Any) -> list[float | None]:
            scores = fn(*args, **kwargs)
            self._scores[key] = [float(s) for s in scores if s is not None]
            return scores

        return scored

    def step_reward(self) -> float | None:
        """The last batch's reward: the sum over the watched functions of their mean score."""
        means = [statistics.fmean(s) for s in self._scores.values() if s]
        return sum(means) if means else None

    # -- TRL's rollout_func ----------------------------------------------------------------
    def rollout(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        """One completion per entry of `prompts` (TRL repeats each prompt num_generations times,
        consecutively): sampled by the pipeline's shards with TRL's sampling settings."""
        args, tokenizer = trainer.args, trainer.processing_class
        ids = [self._tokenize(tokenizer, p) for p in prompts]
        total = len(ids)
        training = bool(trainer.model.training)
        if training:
            self.client.report_progress(0, total)
        params = {"max_tokens": int(args.max_completion_length), "temperature": float(args.temperature),
                  "top_p": float(args.top_p), "top_k": int(args.top_k or 0),
                  "repetition_penalty": float(args.repetition_penalty), "logprobs": 1}
        with ThreadPoolExecutor(min(self.concurrency, max(total, 1))) as pool:
            answers = list(pool.map(lambda p: self._generate(p, params), ids))
        if training:
            self.client.report_progress(total, total)
            self.client.before_training(int(trainer.state.global_step))  # TRL trains on this batch next
        return {"prompt_ids": ids, "completion_ids": [a[0] for a in answers], "logprobs": [a[1] for a in answers]}

    @staticmethod
    def _tokenize(tokenizer: Any, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))

    def _generate(self, prompt_ids: list[int], params: dict) -> tuple[list[int], list[float]]:
        answer = self.http.post("/inference/v1/generate", json={"token_ids": prompt_ids, "sampling_params": params})
        if answer.status_code != 200:
            raise ClientError(f"generate through the pipeline's router answered {answer.status_code}: "
                              f"{answer.text[:300]}")
        choice = answer.json()["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        return [int(t) for t in choice["token_ids"]], [float(c["logprob"]) for c in content]

    def close(self) -> None:
        self.http.close()
        self.client.close()


class _Hooks(TrainerCallback):
    """The pipeline's hooks at TRL's training events (see the module doc)."""

    def __init__(self, adapter: RlixTRL) -> None:
        self.adapter = adapter

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not self.adapter._started:
            # TRL's optimizer exists by now (the Trainer makes it before on_train_begin): on CUDA
            # its state leaves the GPU with the model between steps
            self.adapter.client.start(model, step=int(state.global_step), optimizer=kwargs.get("optimizer"))
            self.adapter._started = True

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        reward = self.adapter.step_reward()
        self.adapter.client.after_training(int(state.global_step) - 1, model,
                                           metrics={} if reward is None else {"reward": reward})
