"""Weights sent from another process over shared memory arrive bit-identical (issue 4, CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch

from rlix.weights.buckets import plan_layout
from rlix.weights.wire import BucketAssembler, Layout
from rlix.weights.transport.shm import ShmReceiver

# The trainer side, in its own process: a seeded state dict, packed and sent bucket by bucket.
# It prints the layout, then one message per bucket, and sends the next only after an ack
# (the shm sender reuses two staging segments, as double buffering allows).
SENDER = textwrap.dedent("""
    import json, sys, torch
    from rlix.weights.buckets import pack, plan_layout
    from rlix.weights.transport.shm import ShmSender
    from tests_weights_state import state_dict
    tensors = state_dict()
    layout = plan_layout(tensors, bucket_bytes=64 << 10)
    print(layout.to_json(), flush=True)
    sender = ShmSender()
    for i, bucket in enumerate(pack(layout, tensors)):
        print(json.dumps(sender.send(7, i, bucket)), flush=True)
        assert sys.stdin.readline().strip() == "ack"
    sender.close()
""")

STATE = textwrap.dedent("""
    import torch
    def state_dict():
        g = torch.Generator().manual_seed(1234)
        out = {}
        for i in range(6):
            out[f"layers.{i}.mlp.weight"] = torch.randn(96, 130, generator=g).to(torch.bfloat16)
            out[f"layers.{i}.norm.weight"] = torch.randn(130, generator=g)
        out["embed.weight"] = torch.randn(300, 128, generator=g).to(torch.float16)  # > one bucket
        out["step"] = torch.tensor([42], dtype=torch.int64)
        return out
""")


def test_weights_cross_processes_over_shm_bit_identical(tmp_path):
    (tmp_path / "tests_weights_state.py").write_text(STATE)
    sys.path.insert(0, str(tmp_path))
    try:
        from tests_weights_state import state_dict
    finally:
        sys.path.remove(str(tmp_path))
    expected = state_dict()

    proc = subprocess.Popen([sys.executable, "-c", SENDER], cwd=tmp_path, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    receiver = ShmReceiver()
    got: dict[str, torch.Tensor] = {}
    try:
        layout = Layout.from_json(proc.stdout.readline())
        assert layout.layout_id == plan_layout(expected, bucket_bytes=64 << 10).layout_id
        assembler = BucketAssembler(layout)
        for _ in range(layout.num_buckets):
            message = json.loads(proc.stdout.readline())
            assert set(message) >= {"version", "bucket", "nbytes", "shm", "offset"}
            bucket = receiver.receive(message)
            for name, tensor in assembler.feed(message["bucket"], bucket):
                got[name] = tensor.clone()  # the staging segment is reused two buckets later
            proc.stdin.write("ack\n")
            proc.stdin.flush()
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        receiver.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    assert set(got) == set(expected) and not assembler.pending()
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
