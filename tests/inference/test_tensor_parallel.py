"""Tensor parallelism of the fused decoder (tp/plan.py): each rank's slices put back
together are the full weights, bad splits are refused by name, and two ranks over gloo give the
single-rank decoder's logits through prefill, decode and a weight update.

Run as a script, this file is one rank of the two-rank test (`_rank_main`)."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import rlix
from rlix.errors import ConfigError
from rlix.httpkit import free_port
from rlix.inference.engine.runner.fused_model import FusedDecoder
from rlix.inference.engine.runner.kv_cache import SlotKVCache
from rlix.inference.engine.runner.model_runner import load_model
from rlix.inference.engine.runner.tp.group import load_rank
from rlix.inference.engine.runner.tp.plan import (ShardPlan, Split, TensorParallel, shard_model,
                                                          shard_state_dict, shard_tensor, sharded_spec,
                                                          split_of)
from rlix.inference.engine.weights import ParamSpec, ServedWeights
from rlix.models.presets import PRESETS, Preset, build_preset

CPU = torch.device("cpu")
PROMPTS = [[5, 17, 99, 3, 250, 42, 8, 61, 7], [11, 2, 300], [45, 46, 47, 48, 49]]
DECODE_STEPS = 3
JOIN_S = 180


# -- slicing -----------------------------------------------------------------------------------

def _synthetic(plan: ShardPlan, layers: int = 2, hidden: int = 24) -> dict[str, torch.Tensor]:
    """A full Qwen2-shaped state dict of random values for `plan`'s counts."""
    q, kv, inter = plan.num_heads * plan.head_dim, plan.num_kv_heads * plan.head_dim, plan.intermediate_size
    named = {"model.embed_tokens.weight": torch.randn(50, hidden), "lm_head.weight": torch.randn(50, hidden),
             "model.norm.weight": torch.randn(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        named.update({
            p + "self_attn.q_proj.weight": torch.randn(q, hidden), p + "self_attn.q_proj.bias": torch.randn(q),
            p + "self_attn.k_proj.weight": torch.randn(kv, hidden), p + "self_attn.k_proj.bias": torch.randn(kv),
            p + "self_attn.v_proj.weight": torch.randn(kv, hidden), p + "self_attn.v_proj.bias": torch.randn(kv),
            p + "self_attn.o_proj.weight": torch.randn(hidden, q),
            p + "mlp.gate_proj.weight": torch.randn(inter, hidden), p + "mlp.up_proj.weight": torch.randn(inter, hidden),
            p + "mlp.down_proj.weight": torch.randn(hidden, inter),
            p + "input_layernorm.weight": torch.randn(hidden),
            p + "post_attention_layernorm.weight": torch.randn(hidden),
        })
    return named


class _FakeGroup:
    """Stands in for a process group where nothing is communicated (slicing only)."""


def _check_slices(named: dict[str, torch.Tensor], plans: list[ShardPlan]) -> None:
    by_rank = [shard_state_dict(plan, named) for plan in plans]
    for name, full in named.items():
        split = split_of(name)
        pieces = [sliced[name] for sliced in by_rank]
        if split is None:
            assert all(piece is full for piece in pieces), name  # passed through, not copied
            continue
        assert torch.equal(torch.cat(pieces, dim=split.value), full), name
        for plan, piece in zip(plans, pieces):
            assert piece.is_contiguous(), name
            spec = sharded_spec(plan, ParamSpec(name, tuple(full.shape), full.dtype))
            assert spec.shape == tuple(piece.shape) and spec.dtype == full.dtype, name
            if split is Split.COLUMN:  # a view of the full tensor's rows, no copy
                assert piece.untyped_storage().data_ptr() == full.untyped_storage().data_ptr(), name


@pytest.mark.parametrize("size", [1, 2, 4])
def test_slices_over_ranks_concatenate_to_the_full_tensors(size):
    counts = dict(num_heads=8, num_kv_heads=4, head_dim=6, intermediate_size=40)
    plans = [ShardPlan(rank, size, **counts) for rank in range(size)]
    torch.manual_seed(0)
    _check_slices(_synthetic(plans[0]), plans)


def test_the_tiny_checkpoint_slices_per_head(tiny_model_dir):
    """The real checkpoint's names and shapes; rank r's q rows are its query heads, its k/v
    rows the KV heads those heads read (GQA: 4 query heads over 2 KV heads, 2 ranks)."""
    model, _ = load_model(tiny_model_dir, CPU, torch.float32)
    plans = [ShardPlan.of(model.config, TensorParallel(rank, 2, _FakeGroup()))
             for rank in range(2)]
    named = load_file(str(tiny_model_dir / "model.safetensors"))
    assert {n for n in named if split_of(n) is not None}  # the checkpoint has split tensors
    _check_slices(named, plans)
    plan, dim = plans[1], plans[1].head_dim
    assert (plan.local_heads, plan.local_kv_heads, plan.local_intermediate) == (2, 1, 256)
    q = named["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(shard_tensor(plan, "model.layers.0.self_attn.q_proj.weight", q), q[2 * dim: 4 * dim])
    k = named["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(shard_tensor(plan, "model.layers.0.self_attn.k_proj.weight", k), k[dim: 2 * dim])


@pytest.mark.parametrize("counts, named", [
    (dict(num_heads=4, num_kv_heads=2, intermediate_size=512), "num_attention_heads (4)"),
    (dict(num_heads=6, num_kv_heads=2, intermediate_size=510), "num_key_value_heads (2)"),
    (dict(num_heads=6, num_kv_heads=3, intermediate_size=512), "intermediate_size (512)"),
])
def test_a_size_that_does_not_divide_is_refused_by_name(counts, named):
    with pytest.raises(ConfigError, match=r"tensor parallel size 3 does not divide .*" + re.escape(named)):
        ShardPlan(0, 3, head_dim=64, **counts)


def test_a_tensor_that_is_not_full_is_refused():
    plan = ShardPlan(0, 2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=16)
    name = "model.layers.0.self_attn.o_proj.weight"
    full = torch.zeros(32, 32)
    half = shard_tensor(plan, name, full)
    assert half.shape == (32, 16)
    with pytest.raises(ValueError, match="not the full tensor"):
        shard_tensor(plan, name, half)
    with pytest.raises(ValueError, match="not the full tensor"):
        sharded_spec(plan, ParamSpec(name, (32, 16), torch.float32))


def test_tensor_parallel_checks_its_place():
    with pytest.raises(ConfigError, match="needs a process group"):
        TensorParallel(0, 2)
    with pytest.raises(ConfigError, match="0 <= rank < size"):
        TensorParallel(2, 2, None)
    x = torch.ones(3)
    assert TensorParallel.single().all_reduce(x) is x


def test_shard_model_keeps_only_the_slices(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, CPU, torch.float32)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = ShardPlan.of(model.config, TensorParallel(1, 2, _FakeGroup()))
    shard_model(model, plan)
    for name, param in model.named_parameters():
        expected = shard_tensor(plan, name, full[name])
        assert torch.equal(param.data, expected), name
        if split_of(name) is not None:  # memory of its own: the full tensor can go
            assert param.data.untyped_storage().nbytes() == param.data.nbytes, name


@pytest.fixture(scope="module")
def seeded_dir(tmp_path_factory):
    """A seeded preset of tiny's shape (no weight files: drawn where loaded)."""
    shape = PRESETS["tiny"]
    seeded = Preset(shape.hidden_size, shape.num_hidden_layers, shape.num_attention_heads,
                    shape.num_key_value_heads, shape.intermediate_size, initializer_range=0.1,
                    dtype="bfloat16", weights="seeded")
    return build_preset("tiny-seeded", tmp_path_factory.mktemp("models") / "tiny-seeded", preset=seeded)


@pytest.mark.parametrize("which", ["files", "seeded"])
def test_a_rank_reads_only_its_slices_and_gets_the_whole_models_cut(tiny_model_dir, seeded_dir, which):
    """load_rank (slices read from the checkpoint, or drawn) equals loading the whole model and
    cutting it, on both ranks, tied embeddings one tensor."""
    path = tiny_model_dir if which == "files" else seeded_dir
    for rank in range(2):
        whole, _ = load_model(path, CPU, torch.float32)
        shard_model(whole, ShardPlan.for_rank(whole.config, rank, 2))
        sliced = load_rank(path, CPU, torch.float32, rank, 2)
        got, want = dict(sliced.named_parameters()), dict(whole.named_parameters())
        assert got.keys() == want.keys()
        for name, param in want.items():
            assert torch.equal(got[name], param), (which, rank, name)
        assert sliced.get_output_embeddings().weight is sliced.get_input_embeddings().weight
        assert torch.equal(sliced.model.rotary_emb.inv_freq, whole.model.rotary_emb.inv_freq)


# -- two ranks ---------------------------------------------------------------------------------

def _decoder(path: Path, tp: TensorParallel) -> tuple[FusedDecoder, ServedWeights, ShardPlan]:
    model, _ = load_model(path, CPU, torch.float32)
    plan = ShardPlan.of(model.config, tp)
    shard_model(model, plan)
    weights = ServedWeights(model, CPU)
    cache = SlotKVCache(num_layers=model.config.num_hidden_layers, num_rows=len(PROMPTS),
                        num_kv_heads=plan.local_kv_heads, head_dim=plan.head_dim, max_len=64,
                        dtype=torch.float32, device=CPU)
    cache.allocate(64)
    decoder = FusedDecoder(model, weights, cache, tp=tp)
    decoder.refresh()
    return decoder, weights, plan


def _run(decoder: FusedDecoder, packed: bool, sdpa_decode: bool,
         tokens: list[list[int]] | None) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill PROMPTS, then DECODE_STEPS greedy steps (or feed `tokens`, another run's picks):
    the logits of each step and the tokens fed."""
    decoder.sdpa_decode = sdpa_decode
    lengths = [len(p) for p in PROMPTS]
    if packed:
        ids = torch.tensor([t for p in PROMPTS for t in p])
        hidden = decoder.prefill_packed(ids, lengths, 0)
        last = hidden[torch.tensor(lengths).cumsum(0) - 1]
    else:
        ids = torch.zeros(len(PROMPTS), max(lengths), dtype=torch.long)
        for i, p in enumerate(PROMPTS):
            ids[i, : len(p)] = torch.tensor(p)
        hidden = decoder.prefill(ids, 0)
        last = hidden[torch.arange(len(PROMPTS)), torch.tensor(lengths) - 1]
    steps, fed = [decoder.logits(last)], []
    pos = torch.tensor(lengths)
    rows = torch.arange(len(PROMPTS))
    for step in range(DECODE_STEPS):
        picks = [int(t) for t in steps[-1].argmax(-1)] if tokens is None else tokens[step]
        fed.append(picks)
        steps.append(decoder.decode(torch.tensor(picks), pos, int(pos.max()) + 1, rows))
        pos = pos + 1
    return steps, fed


def _update(path: Path) -> dict[str, torch.Tensor]:
    """New full values for a few split tensors, as a weight sync sends them (checkpoint names)."""
    full = load_file(str(path / "model.safetensors"))
    return {"model.layers.1.mlp.down_proj.weight": -full["model.layers.1.mlp.down_proj.weight"],
            "model.layers.0.self_attn.q_proj.weight": 0.5 * full["model.layers.0.self_attn.q_proj.weight"],
            "model.layers.0.self_attn.v_proj.bias": full["model.layers.0.self_attn.v_proj.bias"] + 0.1}


@torch.inference_mode()
def _scenarios(path: Path, tp: TensorParallel, tokens: list[list[list[int]]] | None = None
               ) -> tuple[list[list[torch.Tensor]], list[list[list[int]]]]:
    """Packed prefill + SDPA decode, padded prefill + batched-matmul decode, then a weight
    update (each rank keeps its slices of the full tensors) and the first again."""
    decoder, weights, plan = _decoder(path, tp)
    cases = [(True, True), (False, False), (True, True)]
    logits, fed = [], []
    for i, (packed, sdpa) in enumerate(cases):
        if i == 2:
            weights.swap_in(shard_state_dict(plan, _update(path)), complete=False)
            decoder.refresh()
        steps, picks = _run(decoder, packed, sdpa, tokens[i] if tokens is not None else None)
        logits.append(steps)
        fed.append(picks)
    return logits, fed


def _rank_main(argv: list[str]) -> None:
    """One rank of the two-rank test: join the gloo group, refuse an unsharded model, run the
    scenarios and save their logits and picks."""
    parser = argparse.ArgumentParser()
    for flag in ("--rank", "--size", "--port"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.port, args.size, args.rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.size,
                            timeout=timedelta(seconds=60))
    try:
        tp = TensorParallel(args.rank, args.size, dist.group.WORLD)
        model, _ = load_model(args.model, CPU, torch.float32)
        cache = SlotKVCache(num_layers=1, num_rows=1, num_kv_heads=1, head_dim=64, max_len=8,
                            dtype=torch.float32, device=CPU)
        try:
            FusedDecoder(model, ServedWeights(model, CPU), cache, tp=tp)
            raise AssertionError("an unsharded model was accepted at tp > 1")
        except ConfigError as exc:
            assert "shard the model first" in str(exc), exc
        logits, fed = _scenarios(args.model, tp)
        torch.save({"logits": logits, "fed": fed}, args.out / f"rank{args.rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_give_the_single_rank_logits(tiny_model_dir, tmp_path):
    size, port = 2, free_port()
    src = Path(rlix.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    procs: list[subprocess.Popen] = []
    logs = [tmp_path / f"rank{rank}.log" for rank in range(size)]
    try:
        for rank in range(size):
            with logs[rank].open("wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--rank", str(rank), "--size", str(size), "--port", str(port),
                     "--model", str(tiny_model_dir), "--out", str(tmp_path)],
                    env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [proc.wait(timeout=JOIN_S) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    assert codes == [0] * size, "\n".join(f"rank {r}:\n{log.read_text()[-3000:]}" for r, log in enumerate(logs))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(size)]
    assert ranks[0]["fed"] == ranks[1]["fed"]  # every rank picked the same tokens
    reference, fed = _scenarios(tiny_model_dir, TensorParallel.single(), ranks[0]["fed"])
    assert fed == ranks[0]["fed"]
    for case, steps in enumerate(reference):
        for step, ref in enumerate(steps):
            for rank, result in enumerate(ranks):
                torch.testing.assert_close(result["logits"][case][step], ref, atol=1e-4, rtol=1e-4,
                                           msg=lambda m: f"case {case}, step {step}, rank {rank}: {m}")
    # the update changed the logits: the slices landed
    assert (reference[2][0] - reference[0][0]).abs().max() > 1e-2


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
