"""Data parallel: two gloo ranks with half the batch each == one rank with the whole batch,
with a fresh process group (new port) per step, destroyed when the step ends."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlix.training.trainer import PolicyTrainer
from trainer_helpers import capture_grads, grads_close, weights_close

WORKER = Path(__file__).with_name("dp_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_match_one_rank_over_two_steps(tiny_model_dir, samples_factory, tmp_path):
    micro = 2
    single = PolicyTrainer(str(tiny_model_dir), micro_batch_size=micro)
    single_grads = capture_grads(single)
    batches = [samples_factory(8, seed=50 + i, trainer=single) for i in range(2)]
    ports = ",".join(str(free_port()) for _ in batches)
    procs = []
    for rank in range(2):
        share = [[dataclasses.asdict(s) for s in b[rank * 4:(rank + 1) * 4]] for b in batches]
        path = tmp_path / f"batches{rank}.json"
        path.write_text(json.dumps(share))
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(tiny_model_dir), str(rank), "2", str(micro), ports,
             str(path), str(tmp_path / f"out{rank}.pt")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # three processes on a small host: oversubscribed threads crawl
    try:
        expected = [single.train_step(b) for b in batches]
        for p in procs:
            out, _ = p.communicate(timeout=90)
            assert p.returncode == 0, out.decode(errors="replace")[-3000:]
    finally:
        torch.set_num_threads(threads)
        for p in procs:
            if p.poll() is None:
                p.kill()  # by this Popen's own pid
                p.wait()
    results = [torch.load(tmp_path / f"out{r}.pt", weights_only=True) for r in range(2)]
    want = {n: p.detach() for n, p in single.model.named_parameters()}
    for r in results:
        assert r["initialized_after"] is False  # the group did not outlive the step
        for step, (got, exp) in enumerate(zip(r["metrics"], expected)):
            assert got["num_samples"] == 8 and got["num_tokens"] == exp["num_tokens"], step
            assert got["loss"] == pytest.approx(exp["loss"], rel=1e-4, abs=1e-5)
            assert got["grad_norm"] == pytest.approx(exp["grad_norm"], rel=1e-4)
            assert got["clip_fraction"] == pytest.approx(exp["clip_fraction"])
    # The ranks hold bit-identical weights (same averaged gradients, same optimizer), and apply
    # the single rank's gradients up to float noise at every step.
    assert all(torch.equal(results[0]["weights"][n], results[1]["weights"][n]) for n in want)
    # the first step's gradients agree to float noise; a later step starts from weights that
    # already differ by Adam's noise on near-zero gradients (up to lr a weight), so its own agree less
    for step, g in enumerate(single_grads):
        assert grads_close(results[0]["grads"][step], g, rel=1e-4 if step == 0 else 1e-3), step
    assert weights_close(results[0]["weights"], want, lr=1e-3, steps=2)
