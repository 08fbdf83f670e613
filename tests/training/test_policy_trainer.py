"""PolicyTrainer on the tiny preset (CPU): logprob alignment, micro-batching, sync names, cache,
offload, checkpoints, typed errors."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlix.errors import TrainingError
from rlix.training.trainer import PolicyTrainer
from rlix.training.types import TrainSample

from trainer_helpers import capture_grads, grads_close, weights_close


def weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_logprobs_match_a_direct_per_sample_computation(tiny_model_dir, samples_factory):
    """Batched, right-padded, micro-batched logprobs == log_softmax(model(seq))[t-1][token t]."""
    trainer = PolicyTrainer(str(tiny_model_dir), micro_batch_size=3)
    samples = samples_factory(7, seed=1)
    got = trainer.compute_logprobs(samples)
    with torch.no_grad():
        for s, lp in zip(samples, got):
            seq = torch.tensor([s.prompt_ids + s.response_ids])
            logits = trainer.model(input_ids=seq).logits[0].float()
            p = len(s.prompt_ids)
            direct = [torch.log_softmax(logits[p + j - 1], -1)[tok].item()
                      for j, tok in enumerate(s.response_ids)]
            assert len(lp) == len(s.response_ids)
            assert lp == pytest.approx(direct, abs=1e-5)


def test_step_does_not_depend_on_micro_batch_size(tiny_model_dir, samples_factory):
    a = PolicyTrainer(str(tiny_model_dir), micro_batch_size=8)
    b = PolicyTrainer(str(tiny_model_dir), micro_batch_size=3)
    ga, gb = capture_grads(a), capture_grads(b)
    for step in range(2):
        samples = samples_factory(8, seed=10 + step, trainer=a)
        ma, mb = a.train_step(samples), b.train_step(samples)
        assert ma["loss"] == pytest.approx(mb["loss"], abs=1e-5)
        assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-4)
        assert ma["num_tokens"] == mb["num_tokens"] == sum(len(s.response_ids) for s in samples)
        assert ma["num_samples"] == 8 and ma["step"] == step + 1
        assert 0 < ma["clip_fraction"] < 1 and ma["seconds"] > 0
        assert grads_close(ga[step], gb[step])
    assert weights_close(weights(a), weights(b), lr=1e-3, steps=2)
    assert any(not torch.equal(p, PolicyTrainer(str(tiny_model_dir)).model.state_dict()[n])
               for n, p in weights(a).items())


def test_micro_batches_group_samples_by_length_within_the_padded_token_budget(tiny_model_dir):
    """Long-tailed lengths: short samples share a micro-batch, many to one, and no micro-batch
    pads more tokens than micro_batch_size x the longest sample; every sample is in exactly one."""
    trainer = PolicyTrainer(str(tiny_model_dir), micro_batch_size=4)
    lengths = [6] * 40 + [60, 6, 90, 6]  # (prompt 4 + response) per sample
    samples = [TrainSample([1, 2, 3, 4], [5] * (n - 4), [-1.0] * (n - 4), 0.5, 0) for n in lengths]
    chunks = list(trainer._chunks(samples))
    assert sorted(i for c in chunks for i in c) == list(range(len(samples)))
    budget = 4 * max(lengths)
    for c in chunks:
        assert len(c) * max(lengths[i] for i in c) <= budget
    assert len(chunks) == 2  # the 42 short ones together, then 60 and 90 (in batch order: 11)
    assert [sorted(lengths[i] for i in c) for c in chunks] == [[6] * 42, [60, 90]]
    # logprobs come back in the batch's order, whatever the micro-batches' order
    got = trainer.compute_logprobs(samples)
    assert [len(g) for g in got] == [n - 4 for n in lengths]
    one = PolicyTrainer(str(tiny_model_dir), micro_batch_size=1).compute_logprobs(samples)
    assert all(a == pytest.approx(b, abs=1e-5) for a, b in zip(got, one))


def test_sequence_aggregation_and_kl_reference(tiny_model_dir, samples_factory):
    trainer = PolicyTrainer(str(tiny_model_dir), aggregation="sequence", kl_coef=0.1)
    assert trainer.ref_model is not None
    samples = samples_factory(6, seed=3, trainer=trainer)
    first = trainer.train_step(samples)
    assert first["kl"] == pytest.approx(0.0, abs=1e-9)  # policy == reference before any step
    second = trainer.train_step(samples)
    assert second["kl"] > 0
    assert PolicyTrainer(str(tiny_model_dir)).ref_model is None


def test_state_for_sync_names_and_bit_identical_engine_sync(tiny_model_dir, samples_factory):
    from safetensors.torch import load_file

    from rlix.inference.engine.engine import TorchEngine
    from rlix.weights import InProcessEndpoint, ShardUpdater, WeightSync

    trainer = PolicyTrainer(str(tiny_model_dir), cache_bucket_bytes=256 << 10)
    trainer.train_step(samples_factory(4, seed=5, trainer=trainer))
    state = trainer.state_for_sync()
    saved = load_file(str(tiny_model_dir / "model.safetensors"))
    assert set(state) == set(saved)  # tied lm_head is not there, as in the checkpoint
    engine = TorchEngine.from_pretrained(tiny_model_dir, device="cpu", max_num_seqs=2)
    try:
        assert set(state) == set(engine._weights.params)
        cache = trainer.build_cache(1)
        assert trainer.cache is cache and cache.latest_version == 1
        ep = InProcessEndpoint(ShardUpdater(engine), "embedded")
        asyncio.run(WeightSync(cache, {0: ep}, "local").sync(1, [0]))
        assert engine.weight_version == 1
        for n, t in state.items():
            assert torch.equal(engine._weights.params[n].data, t), n
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
        trainer.cache.close()


def test_build_cache_reuses_one_cache_across_versions(tiny_model_dir, samples_factory):
    from rlix.weights import unpack

    trainer = PolicyTrainer(str(tiny_model_dir))
    try:
        first = trainer.build_cache(0)
        trainer.train_step(samples_factory(4, seed=6, trainer=trainer))
        assert trainer.build_cache(1) is first
        first.promote_active(1)
        trainer.train_step(samples_factory(4, seed=7, trainer=trainer))
        trainer.build_cache(2)
        assert first.versions() == (1, 2)
        got = unpack(first.layout, first.buckets(2))
        state = trainer.state_for_sync()
        assert all(torch.equal(got[n], state[n]) for n in state)
    finally:
        trainer.cache.close()


def test_offload_and_reload_on_cpu_keep_training_identical(tiny_model_dir, samples_factory):
    a = PolicyTrainer(str(tiny_model_dir))
    b = PolicyTrainer(str(tiny_model_dir))
    batches = [samples_factory(4, seed=20 + i, trainer=a) for i in range(2)]
    a.train_step(batches[0])
    b.train_step(batches[0])
    b.offload()
    with pytest.raises(TrainingError):
        b.train_step(batches[1])
    b.offload()  # idempotent
    b.reload()
    b.reload()
    a.train_step(batches[1])
    b.train_step(batches[1])
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


def test_checkpoint_resume_is_exact(tiny_model_dir, samples_factory, tmp_path):
    a = PolicyTrainer(str(tiny_model_dir))
    batches = [samples_factory(5, seed=30 + i, trainer=a) for i in range(3)]
    a.train_step(batches[0])
    a.train_step(batches[1])
    a.save_checkpoint(tmp_path / "ckpt")
    a.train_step(batches[2])
    b = PolicyTrainer(str(tiny_model_dir))
    b.load_checkpoint(tmp_path / "ckpt")
    assert b.step == 2
    metrics = b.train_step(batches[2])
    assert b.step == 3 and metrics["step"] == 3
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    # The saved model directory is itself a servable checkpoint (config, weights, tokenizer).
    assert (tmp_path / "ckpt" / "model" / "tokenizer.json").is_file()
    PolicyTrainer(str(tmp_path / "ckpt" / "model"))
    with pytest.raises(TrainingError):
        b.load_checkpoint(tmp_path / "nothing")


def test_bad_input_is_a_typed_error(tiny_model_dir):
    trainer = PolicyTrainer(str(tiny_model_dir))
    ok = TrainSample([1, 2], [3], [-1.0], 1.0, 0)
    bad = [
        [],
        [TrainSample([1, 2], [3, 4], [-1.0], 1.0, 0)],  # logprob count
        [TrainSample([], [3], [-1.0], 1.0, 0)],  # no prompt
        [TrainSample([1, 2], [10_000], [-1.0], 1.0, 0)],  # out of vocabulary
        [TrainSample([1, 2], [], [], 1.0, 0)],  # no response tokens at all
    ]
    for samples in bad:
        with pytest.raises(TrainingError):
            trainer.train_step(samples)
    with pytest.raises(TrainingError):
        PolicyTrainer(str(tiny_model_dir), rank=0, world_size=2).train_step([ok])  # no GroupSpec
    with pytest.raises(TrainingError):
        PolicyTrainer(str(tiny_model_dir), aggregation="batch")  # type: ignore[arg-type]
    assert trainer.step == 0


@pytest.mark.gpu
def test_offload_frees_gpu_memory_and_training_continues_identically(tiny_model_dir, samples_factory):
    a = PolicyTrainer(str(tiny_model_dir), device="cuda")
    b = PolicyTrainer(str(tiny_model_dir), device="cuda")
    batches = [samples_factory(8, seed=40 + i, trainer=a) for i in range(2)]
    a.train_step(batches[0])
    b.train_step(batches[0])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    b.offload()
    after = torch.cuda.memory_allocated()
    # b's weights, grads-free AdamW moments: at least 3x the parameter bytes leave the GPU.
    param_bytes = sum(p.numel() * p.element_size() for p in b.model.parameters())
    assert before - after >= 3 * param_bytes * 0.99
    assert all(p.device.type == "cpu" for p in b.model.parameters())
    b.reload()
    assert all(p.device.type == "cuda" for p in b.model.parameters())
    a.train_step(batches[1])
    b.train_step(batches[1])
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


def test_loss_mask_leaves_context_tokens_out_of_the_loss(tiny_model_dir, samples_factory):
    """Multi-turn samples: tokens under a 0 in `loss_mask` (tool outputs between turns) are
    context only: their behaviour logprobs change nothing, and only masked-in tokens count."""
    base = samples_factory(4, seed=5)
    masks = [[1 if (j // 3) % 2 == 0 else 0 for j in range(len(s.response_ids))] for s in base]

    def with_context_logprobs(value: float) -> list[TrainSample]:
        return [TrainSample(s.prompt_ids, s.response_ids,
                            [lp if m else value for lp, m in zip(s.behaviour_logprobs, mask)],
                            s.advantage, s.version, mask) for s, mask in zip(base, masks)]

    runs = []
    for value in (5.0, -3.0):
        trainer = PolicyTrainer(str(tiny_model_dir), micro_batch_size=3)
        grads = capture_grads(trainer)
        metrics = trainer.train_step(with_context_logprobs(value))
        runs.append((metrics, grads[0]))
    (m1, g1), (m2, g2) = runs
    assert m1["num_tokens"] == sum(map(sum, masks)) < sum(len(s.response_ids) for s in base)
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6) and grads_close(g1, g2)
    unmasked = PolicyTrainer(str(tiny_model_dir), micro_batch_size=3)
    gu = capture_grads(unmasked)
    mu = unmasked.train_step(base)  # the same tokens, all of them trained on
    assert mu["num_tokens"] == sum(len(s.response_ids) for s in base)
    assert mu["loss"] != pytest.approx(m1["loss"], abs=1e-4) and not grads_close(g1, gu[0])
    with pytest.raises(TrainingError, match="loss-mask entries"):
        trainer.train_step([TrainSample(base[0].prompt_ids, base[0].response_ids, base[0].behaviour_logprobs,
                                        1.0, 0, [1])])


def test_sync_buckets_are_64_mib_on_cpu_256_on_cuda_unless_the_config_names_a_size(tiny_model_dir):
    from rlix.config.models import TrainConfig
    from rlix.weights.buckets import default_bucket_bytes

    assert default_bucket_bytes("cuda:0") == 256 << 20 and default_bucket_bytes("cpu") == 64 << 20
    assert PolicyTrainer.from_config(str(tiny_model_dir), TrainConfig()).cache_bucket_bytes == 64 << 20
    named = PolicyTrainer.from_config(str(tiny_model_dir), TrainConfig(bucket_mib=8))
    assert named.cache_bucket_bytes == 8 << 20
    assert named.build_cache(1).layout.bucket_bytes == 8 << 20
