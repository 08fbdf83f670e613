"""Which physical GPU each of rlix's GPU ids is, and how rlix keeps Ray from giving it away.

The scheduler's ledger numbers GPUs 0..N-1, node by node (nodes in `topology_from_ray`'s
order). `GpuReservation.reserve` turns those numbers into real devices: one placement group per
node, one `{"GPU": 1}` bundle per GPU, pinned to the node by its `ray.io/node-id` label (not its
IP: the nodes of a cluster simulated on one machine share one). Ray
reserves a bundle's GPU for the group for as long as the group exists, so no other Ray task or
actor can be scheduled onto it while rlix runs: the whole fraction is ours to time-share. A
probe task in every bundle reads which device Ray gave it (`ray.get_gpu_ids()`), so GPU g is
known as (node, physical id).

Every process rlix places sees exactly its GPUs: a trainer actor is scheduled into its GPU's
bundle with a small GPU fraction (Ray then sets its CUDA_VISIBLE_DEVICES), and a shard server,
a child of its pipeline's actor, is started with CUDA_VISIBLE_DEVICES set to the physical ids
(`visible_devices`). On CPU the same happens with Ray's fake GPUs (`ray.init(num_gpus=N)`), so
placement is tested without CUDA.

With `cluster.gpu_slices: N` the scheduler's GPU g is slice g % N of physical GPU g // N (per
node): every slice of a GPU maps to that GPU's one bundle, and `memory_share` (1/N) is the
fraction of its memory a process placed on a slice may allocate (it caps its own allocator).
"""

from __future__ import annotations

import glob
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rlix.errors import ConfigError
from rlix.scheduler.types import Topology

#: the GPU fraction one placed actor asks of its bundle: many processes time-share one GPU
ACTOR_GPU_FRACTION = 0.01


@dataclass(frozen=True)
class GpuSlot:
    gpu: int  # rlix's id: the scheduler's ledger index
    node: int  # index of its node in the topology
    node_ip: str
    physical: str  # the id CUDA_VISIBLE_DEVICES names on that node
    bundle: int  # index of its bundle in the node's placement group
    has_cuda: bool  # the node has NVIDIA devices (else Ray's GPUs are fake)
    memory_share: float = 1.0  # of the physical GPU's memory: 1/gpu_slices
    node_id: str = ""  # the Ray node it is on


def on_this_node(soft: bool = False) -> dict[str, Any]:
    """Ray options that keep an actor on the caller's node: pipeline actors write the run dir
    there, and a node lost elsewhere must not take a pipeline's control with it."""
    node = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=soft)}


@ray.remote(num_cpus=0, num_gpus=ACTOR_GPU_FRACTION)
def _probe() -> tuple[str, str, list[str], int]:
    """What a process placed in a bundle sees: its node (address, id), its GPU ids, how many
    NVIDIA devices the node has (0: Ray's GPUs there are fake)."""
    node_ip = ray.util.get_node_ip_address()
    node_id = ray.get_runtime_context().get_node_id()
    return node_ip, node_id, [str(g) for g in ray.get_gpu_ids()], len(glob.glob("/dev/nvidia[0-9]*"))


class GpuReservation:
    """rlix's GPUs, held by placement groups for the run; see module doc. Picklable (it travels
    to the pipeline actors)."""

    def __init__(self, slots: Sequence[GpuSlot], groups: Sequence[PlacementGroup]) -> None:
        self.slots = list(slots)
        self.groups = list(groups)

    @classmethod
    def reserve(cls, topology: Topology, timeout_s: float = 60.0, *, slices: int = 1,
                fake: bool = False) -> GpuReservation:
        """Reserve every GPU of `topology` (physical GPUs) on the alive Ray nodes that have GPUs
        (in the scheduler's order); a clear error if Ray cannot give them within `timeout_s`.
        The slots are the scheduler's GPUs: `slices` per physical GPU. `fake`: the run computes
        on CPU, so Ray's GPUs are fake ones even on a node with NVIDIA devices, and may outnumber
        them."""
        nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0]
        nodes.sort(key=lambda n: (n.get("NodeManagerAddress", ""), n.get("NodeID", "")))
        if len(nodes) < topology.num_nodes:
            raise ConfigError(f"the cluster has {topology.num_nodes} node(s) with GPUs in its config but "
                              f"Ray has {len(nodes)} alive node(s) with GPUs")
        groups: list[PlacementGroup] = []
        for node, count in enumerate(topology.gpus_per_node):
            info = nodes[node]
            have = int(info["Resources"]["GPU"])
            if have < count:
                raise ConfigError(f"node {node} ({info['NodeManagerAddress']}) has {have} GPU(s); the "
                                  f"cluster config asks for {count}")
            pin = {"ray.io/node-id": info["NodeID"]}
            groups.append(placement_group([{"GPU": 1} for _ in range(count)], strategy="STRICT_PACK",
                                          bundle_label_selector=[pin] * count, name=f"rlix-gpus-node{node}"))
        try:
            ready = ray.get([g.ready() for g in groups], timeout=timeout_s)
            del ready
        except Exception as exc:  # noqa: BLE001 - any failure to reserve is one clear error
            for g in groups:
                remove_placement_group(g)
            raise ConfigError(f"could not reserve the cluster's {topology.num_gpus} GPU(s) from Ray "
                              f"within {timeout_s:g} s (are other jobs holding them?): "
                              f"{type(exc).__name__}") from None
        probes = []
        for node, count in enumerate(topology.gpus_per_node):
            for bundle in range(count):
                strategy = PlacementGroupSchedulingStrategy(groups[node], placement_group_bundle_index=bundle)
                probes.append((node, bundle, _probe.options(scheduling_strategy=strategy).remote()))
        slots = []
        for gpu, (node, bundle, ref) in enumerate(probes):
            node_ip, node_id, ids, devices = ray.get(ref)
            physical = ids[0] if ids else str(bundle)
            if fake:
                devices = 0
            if devices and physical.isdigit() and int(physical) >= devices:
                for g in groups:
                    remove_placement_group(g)
                raise ConfigError(f"GPU {gpu}: Ray placed it on device {physical} of node {node_ip}, "
                                  f"which has {devices} NVIDIA device(s); the cluster config asks "
                                  f"for more GPUs than the node has")
            for part in range(slices):
                slots.append(GpuSlot(gpu * slices + part, node, node_ip, physical, bundle, devices > 0,
                                     memory_share=1.0 / slices, node_id=node_id))
        return cls(slots, groups)

    @property
    def memory_share(self) -> float:
        """The fraction of a GPU's memory each placed process may use (1/gpu_slices)."""
        return min((s.memory_share for s in self.slots), default=1.0)

    @property
    def has_cuda(self) -> bool:
        return bool(self.slots) and all(s.has_cuda for s in self.slots)

    @property
    def node_ids(self) -> list[str]:
        """The Ray nodes whose GPUs are reserved, in the scheduler's node order."""
        return list(dict.fromkeys(s.node_id for s in self.slots))

    @property
    def multi_node(self) -> bool:
        return len(self.node_ids) > 1

    def node_of(self, gpus: Sequence[int]) -> str:
        """The Ray node these GPUs are on (a process placed on them runs there)."""
        nodes = {self.slot(g).node_id for g in gpus}
        if len(nodes) != 1:
            raise ConfigError(f"GPUs {list(gpus)} span {len(nodes)} nodes; one process needs one node")
        return nodes.pop()

    def gpus_on(self, node_id: str) -> list[int]:
        """rlix's GPUs (slices included) on one Ray node."""
        return [s.gpu for s in self.slots if s.node_id == node_id]

    def slot(self, gpu: int) -> GpuSlot:
        if not 0 <= gpu < len(self.slots):
            raise ConfigError(f"GPU {gpu} is not among the reserved 0..{len(self.slots) - 1}")
        return self.slots[gpu]

    def visible_devices(self, gpus: Iterable[int]) -> str:
        """CUDA_VISIBLE_DEVICES for a process placed on these rlix GPUs (one node)."""
        slots = [self.slot(g) for g in gpus]
        if len({s.node for s in slots}) > 1:
            raise ConfigError(f"GPUs {[s.gpu for s in slots]} span several nodes; one process needs one node")
        physical = [s.physical for s in slots]
        if len(set(physical)) != len(physical):
            raise ConfigError(f"GPUs {[s.gpu for s in slots]} are slices of the same device; one process "
                              f"takes one slice of a GPU")
        return ",".join(physical)

    def actor_options(self, gpus: Sequence[int]) -> dict[str, Any]:
        """Ray options that put an actor on these rlix GPUs (Ray sets its CUDA_VISIBLE_DEVICES to
        the first one's bundle; more than one GPU per process is not supported yet)."""
        if len(gpus) != 1:
            raise ConfigError(f"a placed process takes one GPU, got {list(gpus)} (data-parallel "
                              f"trainer ranks across GPUs are one process each)")
        slot = self.slot(gpus[0])
        strategy = PlacementGroupSchedulingStrategy(self.groups[slot.node],
                                                    placement_group_bundle_index=slot.bundle)
        return {"num_gpus": ACTOR_GPU_FRACTION, "scheduling_strategy": strategy}

    def host_options(self, gpus: Sequence[int]) -> dict[str, Any]:
        """Ray options that put an actor hosting a process placed on `gpus` (all on one node)
        into the first one's bundle, so on that node; the process itself is told its GPUs
        (`visible_devices`), the actor computes nothing."""
        self.node_of(gpus)
        return self.actor_options(list(gpus)[:1])

    def release(self) -> None:
        for g in self.groups:
            try:
                remove_placement_group(g)
            except Exception:  # noqa: BLE001 - Ray may be shutting down already
                pass
        self.groups = []
