"""The one place rlix reads environment variables.

Everything else asks this module, so the full set of knobs is visible in one file.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Literal, NamedTuple

ControlPlane = Literal["rlix", "standalone"]


def control_plane(default: ControlPlane = "standalone") -> ControlPlane:
    """`RLIX_CONTROL_PLANE=rlix` switches a pipeline into time-sharing mode."""
    value = os.environ.get("RLIX_CONTROL_PLANE", "").strip().lower()
    if value in ("rlix", "standalone"):
        return value  # type: ignore[return-value]
    return default


def ray_address() -> str | None:
    """Address of an existing Ray cluster to join (`RAY_ADDRESS`); None starts a local one."""
    return os.environ.get("RAY_ADDRESS") or None


def join_ray_with_token() -> None:
    """Before Ray is imported, in a process that may join a running cluster: Ray (2.60) secures
    a cluster it starts with the token in ~/.ray/auth_token, but a process that joins one sends
    it only when told to (`RAY_AUTH_MODE=token`, read once at import; processes we start inherit
    it); an explicit RAY_AUTH_MODE is left as it is. Once Ray is imported it is too late: this
    process would go on without the token while the Ray servers it starts inherit the setting
    and demand one (a command run inside a program that already imported Ray: nothing is set)."""
    if "ray" in sys.modules:
        return
    if "RAY_AUTH_MODE" not in os.environ and (Path.home() / ".ray" / "auth_token").exists():
        os.environ["RAY_AUTH_MODE"] = "token"


#: Ray's switch (read once, when Ray is imported) between a Ray for this machine alone and one
#: that other machines may join. "0": a Ray started here takes the loopback address as its node IP,
#: and each of its servers (GCS, raylet and object manager, every worker's and driver's gRPC
#: server, the runtime-env and dashboard agents, the metrics exporters) binds loopback because of
#: it; `ray start --address` (another node joining) is refused. Unset or "1" (Ray's default on
#: Linux): the machine's IP, and Ray's gRPC servers listen on every interface.
RAY_CLUSTER_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_ray_on_loopback(environ: MutableMapping[str, str] | None = None) -> None:
    """Before Ray is imported, in an rlix command (or in the environment `environ` of a process
    we start): a Ray it starts (`rlix run` without an address, the `rlix up` head, a simulated
    cluster) listens on 127.0.0.1 only, and processes started from it inherit the setting, so
    they can join it (a process without it turns the address 127.0.0.1:port into the machine's
    IP, where nothing listens). Joining a cluster elsewhere is unaffected. An explicit
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is left as it is: "1" widens a Ray rlix starts to every
    interface, for machines that are to join it."""
    (os.environ if environ is None else environ).setdefault(RAY_CLUSTER_VAR, "0")


def ray_widened() -> bool:
    """Whether the user asked for a Ray that listens beyond this machine (RAY_CLUSTER_VAR set
    to "1" or "true", as Ray reads it)."""
    return os.environ.get(RAY_CLUSTER_VAR, "").strip().lower() in ("1", "true")


def ray_token_path() -> Path:
    """Where Ray keeps the token that admits a process to its cluster: `RAY_AUTH_TOKEN_PATH`,
    else ~/.ray/auth_token (Ray's own default)."""
    value = os.environ.get("RAY_AUTH_TOKEN_PATH", "").strip()
    return Path(value).expanduser() if value else Path.home() / ".ray" / "auth_token"


def ray_token() -> str | None:
    """The Ray token this process holds, where Ray itself looks: `RAY_AUTH_TOKEN`, else the file
    at ray_token_path(); None when there is none it can read. rlix only uses it as a key (the
    proof a job's submitter holds it, rlix.cluster.intake): never printed, logged or passed on."""
    value = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if value:
        return value
    try:
        return ray_token_path().read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def ray_token_auth() -> bool:
    """Whether this process's Ray uses token authentication (`RAY_AUTH_MODE=token`, which Ray
    itself sets when it starts or joins a cluster with a token)."""
    return os.environ.get("RAY_AUTH_MODE", "").strip().lower() == "token"


def cache_dir() -> Path:
    """Where rlix keeps built artefacts (model presets...): `RLIX_CACHE_DIR`, else ~/.cache/rlix."""
    value = os.environ.get("RLIX_CACHE_DIR", "").strip()
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    return Path(base).expanduser() / "rlix"


def user() -> str:
    """Who submits a job to a shared cluster (`RLIX_USER`, else `USER`, else "unknown")."""
    return (os.environ.get("RLIX_USER") or os.environ.get("USER") or "unknown").strip() or "unknown"


#: the bearer token of engine servers and routers. How rlix hands a token to a process it starts:
#: never on the command line (/proc/PID/cmdline is readable by every user of the machine;
#: /proc/PID/environ only by the process's owner)
API_KEY_VAR = "RLIX_API_KEY"
#: the token a router sends its shards, when not its own (`rlix router --shard-api-key`)
SHARD_API_KEY_VAR = "RLIX_SHARD_API_KEY"
#: where vLLM's OpenAI server reads its token (what `--api-key` would give, off the command line)
VLLM_API_KEY_VAR = "VLLM_API_KEY"
#: every variable that may hold a token: a process rlix starts gets only the one it needs
TOKEN_VARS = (API_KEY_VAR, SHARD_API_KEY_VAR, VLLM_API_KEY_VAR)


def api_key() -> str | None:
    """Bearer token for engine-server and router control endpoints (`RLIX_API_KEY`), if set."""
    return os.environ.get(API_KEY_VAR, "").strip() or None


def shard_api_key() -> str | None:
    """The token a router sends its shards (`RLIX_SHARD_API_KEY`), if set; else its own."""
    return os.environ.get(SHARD_API_KEY_VAR, "").strip() or None


def child_env(overrides: dict[str, str] | None = None, *, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a process we start: ours without the variables in `drop` (e.g.
    TOKEN_VARS: a token goes only to a child that needs it), then `overrides`."""
    out = {k: v for k, v in os.environ.items() if k not in drop}
    out.update(overrides or {})
    return out


#: how a program rlix starts for an `external:` pipeline finds it (rlix.client.connect): the
#: Ray cluster's address, the namespace and name of the pipeline's actor. No secret: Ray's own
#: token authenticates the connection, and the router's token is asked of the actor over it.
CLIENT_RAY_ADDRESS_VAR = "RLIX_CLIENT_RAY_ADDRESS"
CLIENT_NAMESPACE_VAR = "RLIX_CLIENT_NAMESPACE"
CLIENT_ACTOR_VAR = "RLIX_CLIENT_ACTOR"


class ClientTarget(NamedTuple):
    """Where rlix.client.connect() finds its pipeline (see CLIENT_*_VAR)."""

    ray_address: str
    namespace: str
    actor: str

    def as_env(self) -> dict[str, str]:
        return {CLIENT_RAY_ADDRESS_VAR: self.ray_address, CLIENT_NAMESPACE_VAR: self.namespace,
                CLIENT_ACTOR_VAR: self.actor}


def client_target() -> ClientTarget | None:
    """The pipeline this process was started for (None: not started by rlix as one)."""
    values = [os.environ.get(v, "").strip() for v in (CLIENT_RAY_ADDRESS_VAR, CLIENT_NAMESPACE_VAR, CLIENT_ACTOR_VAR)]
    return ClientTarget(*values) if all(values) else None


#: an environment server's settings (EnvConfig as JSON), off the command line: its `options`
#: are the user's (they may hold credentials of the tools it calls)
ENV_SERVER_CONFIG_VAR = "RLIX_ENV_SERVER_CONFIG"


def env_server_config() -> str | None:
    """`RLIX_ENV_SERVER_CONFIG`: the settings an environment server was started with, if set."""
    return os.environ.get(ENV_SERVER_CONFIG_VAR) or None


def vllm_python() -> str | None:
    """Python executable of an environment with vLLM installed: `RLIX_VLLM_PYTHON`, else the
    wrapper scripts/setup-vllm.sh puts in this environment's bin/, else None."""
    value = os.environ.get("RLIX_VLLM_PYTHON", "").strip()
    if value:
        return value
    linked = Path(sys.prefix) / "bin" / "rlix-vllm-python"
    return str(linked) if linked.exists() else None


NCCL_DEFAULTS = {
    # NVLink multicast (NVLS) is off on the lent GPU machines; NCCL must not try it.
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def apply_nccl_defaults() -> None:
    """Set the NCCL safety knobs in this process (and so its children) unless already set."""
    for key, value in NCCL_DEFAULTS.items():
        os.environ.setdefault(key, value)


def nccl_child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment for a process we start that will use NCCL: ours, plus the safety knobs."""
    out = dict(os.environ if base is None else base)
    for key, value in NCCL_DEFAULTS.items():
        out.setdefault(key, value)
    return out


def visible_devices() -> str | None:
    """`CUDA_VISIBLE_DEVICES` of this process: the GPUs placement gave it (None: not set)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


#: the variable through which a placed process is shown only its GPUs
VISIBLE_DEVICES_VAR = "CUDA_VISIBLE_DEVICES"

#: the fraction of its GPU's memory a shard placed on a slice may use (`cluster.gpu_slices`)
GPU_MEMORY_SHARE_VAR = "RLIX_GPU_MEMORY_SHARE"


def gpu_memory_share() -> float:
    """`RLIX_GPU_MEMORY_SHARE` of this process (1.0 when unset); a value outside (0, 1] is an
    error, not a silent whole GPU."""
    raw = os.environ.get(GPU_MEMORY_SHARE_VAR, "").strip()
    if not raw:
        return 1.0
    try:
        share = float(raw)
    except ValueError:
        share = -1.0
    if not 0 < share <= 1:
        raise ValueError(f"{GPU_MEMORY_SHARE_VAR}={raw!r}: give a fraction in (0, 1]")
    return share


def process_env(pid: int, name: str) -> str | None:
    """Variable `name` of the environment another process of ours was started with (from
    /proc; None if unset or unreadable): how a placement is checked, not assumed."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            entries = fh.read().split(b"\0")
    except OSError:
        return None
    prefix = name.encode() + b"="
    for entry in entries:
        if entry.startswith(prefix):
            return entry[len(prefix):].decode()
    return None


def process_visible_devices(pid: int) -> str | None:
    """`CUDA_VISIBLE_DEVICES` another process of ours was started with (see process_env)."""
    return process_env(pid, VISIBLE_DEVICES_VAR)


def c_compiler() -> str | None:
    """The C compiler that builds rlix's CPU kernels: `CC`, else `cc` or `gcc` on the PATH;
    None when there is none (the engine then keeps torch's matmuls)."""
    value = os.environ.get("CC", "").strip()
    if value:
        return shutil.which(value) or (value if Path(value).exists() else None)
    return shutil.which("cc") or shutil.which("gcc")


def cpu_kernels_enabled() -> bool:
    """`RLIX_CPU_KERNELS=0` keeps the embedded engine on torch's matmuls on CPU (for A/B timing
    or a compiler that miscompiles); on by default."""
    return os.environ.get("RLIX_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")
