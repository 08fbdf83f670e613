"""wire.py runs where rlix is not installed (inside a vLLM server): torch + stdlib only."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import rlix.weights.wire as wire_module
from rlix.weights.cache import BucketCache

WIRE = Path(wire_module.__file__)


def test_imports_only_torch_and_the_standard_library():
    tree = ast.parse(WIRE.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    assert roots - set(sys.stdlib_module_names) == {"torch"}


CHILD = textwrap.dedent("""
    import json, sys
    class Block:  # rlix, numpy and pydantic must not be needed
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("rlix", "numpy", "pydantic"):
                raise ModuleNotFoundError(f"blocked: {name}")
    sys.meta_path.insert(0, Block())
    import wire
    job = json.load(open(sys.argv[1]))
    layout = wire.Layout.from_json(job["layout"])
    layout.check_against({n: (s, getattr(__import__("torch"), d)) for n, (s, d) in job["specs"].items()})
    session = wire.ReceiveSession(wire.BucketAssembler(layout), job["version"], verify=True)
    mapper = wire.ShmMapper()
    out = {}
    for msg in job["messages"]:
        bucket = mapper.bucket(msg["shm"], msg["offset"], msg["nbytes"])
        for name, t in session.accept(msg, bucket):
            out[name] = t.clone()
    session.close()
    import torch
    torch.save(out, job["out"])
    assert "rlix" not in sys.modules and "numpy" not in sys.modules
    print("ok", len(out))
""")


def test_rebuilds_tensors_from_shared_memory_without_rlix(tmp_path):
    gen = torch.Generator().manual_seed(0)
    sd = {"embed": torch.randn(400, 32, generator=gen).bfloat16(),
          "w": torch.randn(48, 48, generator=gen), "ids": torch.arange(50)}
    with BucketCache.for_model(sd, bucket_bytes=8192, host="shm") as cache:
        cache.build_latest(5, sd)
        seg = cache.shm_segments()[0]
        base = seg.tensor.data_ptr()
        messages = [{"version": 5, "bucket": i, "nbytes": b.numel(), "checksum": c, "shm": seg.name,
                     "offset": b.data_ptr() - base}
                    for i, (b, c) in enumerate(zip(cache.buckets(5), cache.checksums(5)))]
        job = {"layout": cache.layout.to_json(), "version": 5, "messages": messages,
               "specs": {n: (list(t.shape), str(t.dtype).split(".")[1]) for n, t in sd.items()},
               "out": str(tmp_path / "out.pt")}
        (tmp_path / "job.json").write_text(json.dumps(job))
        alone = tmp_path / "alone"
        alone.mkdir()
        shutil.copy(WIRE, alone / "wire.py")
        proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "job.json")], cwd=alone,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"ok {len(sd)}"
    out = torch.load(tmp_path / "out.pt")
    for name, t in sd.items():
        assert torch.equal(out[name], t), name
