"""rlix's own bf16 matmuls for a decode step's few rows on CPU (csrc/bf16_rows.c).

Why: a decode step reads every weight once for a handful of rows, so it is bound by how fast
the weights stream from memory. torch's bf16 matmul on an AVX2 CPU streams them at a fraction
of that rate, and oneDNN's reordered copies need AVX-512; the kernel here converts bf16 to fp32
in registers and stays near the read rate at 1-8 rows on either (docs/INFERENCE_ENGINE.md).

The C file is compiled once per source and compiler into rlix's cache directory (`env.cache_dir`)
with the system's C compiler and loaded with ctypes (the call releases the GIL). Where there is
no compiler, no AVX2, or the build fails, `load()` returns None and says why once; the engine then
keeps torch's matmuls. `RLIX_CPU_KERNELS=0` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from rlix import env

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "bf16_rows.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c11")
#: rows of x per pass over the weights (MAX_ROWS in the C file); more rows take more passes
MAX_ROWS = 32
_BUILD_TIMEOUT_S = 120


class Bf16RowKernels:
    """The loaded library: bf16 `linear` and the MLP's `silu_gate_up`."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        ptr, i32 = ctypes.c_void_p, ctypes.c_int
        self._linear = lib.rlix_linear_bf16
        self._linear.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32]
        self._linear.restype = ctypes.c_int
        self._gate_up = lib.rlix_silu_gate_up_bf16
        self._gate_up.argtypes = [ptr, ptr, ptr, i32, i32, i32, i32]
        self._gate_up.restype = ctypes.c_int
        self.path = path

    @staticmethod
    def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether x @ weight.T can run here: bf16 on CPU, 2-D, contiguous, K % 16 == 0."""
        return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.dim() == 2
                and x.device.type == "cpu" and x.shape[0] > 0
                and x.shape[1] == weight.shape[1] and x.shape[1] % 16 == 0
                and x.is_contiguous() and weight.is_contiguous())

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """(residual +) x @ weight.T (+ bias), x [M, K], weight [N, K]."""
        rows, n = x.shape[0], weight.shape[0]
        out = torch.empty(rows, n, dtype=x.dtype)
        if bias is not None:
            bias = bias.contiguous()
        if residual is not None:
            residual = residual.contiguous()
            assert residual.shape == out.shape and residual.dtype == out.dtype
        status = self._linear(x.data_ptr(), weight.data_ptr(),
                              bias.data_ptr() if bias is not None else None,
                              residual.data_ptr() if residual is not None else None, out.data_ptr(),
                              rows, n, x.shape[1], torch.get_num_threads())
        if status != 0:
            raise MemoryError(f"rlix_linear_bf16: no memory for {rows} x {x.shape[1]} fp32 rows")
        return out

    def silu_gate_up(self, x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T) for gate_up = [gate; up] ([2I, K])."""
        rows, inter = x.shape[0], gate_up.shape[0] // 2
        out = torch.empty(rows, inter, dtype=x.dtype)
        status = self._gate_up(x.data_ptr(), gate_up.data_ptr(), out.data_ptr(), rows, inter,
                               x.shape[1], torch.get_num_threads())
        if status != 0:
            raise MemoryError(f"rlix_silu_gate_up_bf16: no memory for {rows} x {x.shape[1]} fp32 rows")
        return out


@functools.cache
def load() -> Bf16RowKernels | None:
    """The kernels, built on first use; None where they cannot run here (the reason logged once)."""
    kernels, reason = _build_and_load()
    if kernels is None:
        log.info("rlix CPU kernels off: %s; bf16 matmuls stay on torch", reason)
    return kernels


def unavailable_reason() -> str | None:
    """Why `load()` returns None here, without building anything (None: it may load)."""
    if not env.cpu_kernels_enabled():
        return "RLIX_CPU_KERNELS=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU has no AVX2 (torch sees {torch.backends.cpu.get_cpu_capability()})"
    if env.c_compiler() is None:
        return "no C compiler (cc, gcc or $CC)"
    return None


def _build_and_load() -> tuple[Bf16RowKernels | None, str | None]:
    reason = unavailable_reason()
    if reason is not None:
        return None, reason
    compiler = env.c_compiler()
    assert compiler is not None
    try:
        path = _build(compiler)
        return Bf16RowKernels(path), None
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        return None, f"build failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"


def _build(compiler: str) -> Path:
    """Compile SOURCE into the cache (once per source, flags and compiler); the library appears
    under its final name only when complete, so processes starting together never load half a
    file."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout.splitlines()[:1]
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(),
                 "".join(version).encode()):
        digest.update(part)
    out_dir = env.cache_dir() / "kernels"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"bf16_rows-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".bf16_rows-", suffix=".so")
    os.close(fd)
    try:
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"],
                                capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise RuntimeError(result.stderr.strip() or f"{compiler} exited {result.returncode}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
