"""Bucket layout: pack -> unpack is bit-identical; the layout travels as JSON; mismatches refused.

(The rest of issue 4's tests -- cross-process shm sync, selective sync, faults, GPU transports --
are not written yet.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlix.errors import WeightUpdateError
from rlix.weights.buckets import pack, plan_layout, unpack
from rlix.weights.wire import Layout

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes, so NaN payloads and -0.0 count too."""
    return t.contiguous().reshape(-1).view(torch.uint8)


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30)), min_size=1, max_size=8),
       dtypes=st.lists(st.sampled_from(DTYPES), min_size=8, max_size=8),
       bucket_bytes=st.sampled_from([256, 512, 1024, 4096]))
def test_pack_unpack_is_bit_identical(shapes, dtypes, bucket_bytes):
    gen = torch.Generator().manual_seed(len(shapes) * 1000 + bucket_bytes)
    tensors = {}
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        raw = torch.randint(0, 256, (shape[0] * shape[1] * torch.empty(0, dtype=dtype).element_size(),),
                            dtype=torch.uint8, generator=gen)
        tensors[f"layer{i}.weight"] = raw.view(dtype).reshape(shape)
    layout = plan_layout(tensors, bucket_bytes=bucket_bytes)
    buckets = pack(layout, tensors)
    assert all(b.numel() <= bucket_bytes for b in buckets)
    out = unpack(Layout.from_json(layout.to_json()), buckets)
    assert set(out) == set(tensors)
    for name, t in tensors.items():
        assert out[name].shape == t.shape and out[name].dtype == t.dtype
        assert torch.equal(bits(out[name]), bits(t)), name


def test_tensor_larger_than_a_bucket_is_split_and_reassembled():
    tensors = {"big": torch.arange(1000, dtype=torch.float32), "small": torch.ones(3)}
    layout = plan_layout(tensors, bucket_bytes=1024)
    assert layout.num_buckets >= 4
    out = unpack(layout, pack(layout, tensors))
    assert torch.equal(out["big"], tensors["big"]) and torch.equal(out["small"], tensors["small"])


def test_mismatched_tensors_are_refused_before_packing():
    layout = plan_layout({"w": torch.zeros(4, 4)}, bucket_bytes=1024)
    with pytest.raises(WeightUpdateError, match="does not match"):
        pack(layout, {"w": torch.zeros(4, 5)})
    with pytest.raises(WeightUpdateError, match="does not match"):
        pack(layout, {"w": torch.zeros(4, 4, dtype=torch.float16)})
    with pytest.raises(WeightUpdateError, match="missing"):
        pack(layout, {"v": torch.zeros(4, 4)})


def test_wire_module_needs_only_torch_and_the_standard_library(tmp_path):
    """A real vLLM server loads it as a worker extension, where rlix is not installed."""
    src = Path(__file__).resolve().parents[2] / "src" / "rlix" / "weights" / "wire.py"
    (tmp_path / "wire_alone.py").write_text(src.read_text())
    # rlix made unimportable (an entry of None in sys.modules), whatever the paths are named
    code = ("import sys; sys.modules['rlix'] = None; "
            "import wire_alone, torch; print('ok', sys.modules['rlix'] is None)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "True"]
