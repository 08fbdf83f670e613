"""A Ray cluster of several nodes on this one machine, each node with its own fake GPUs.

`rlix run` starts one when a config asks for more than one node and no cluster is given to
attach to: the multi-node paths (shards and trainers as actors on their node, a weight replica
per node, a node leaving mid-run) then run for real, only the wire is local. Each node is its
own raylet with its own object store and worker processes, so killing a node's raylet by its
PID takes that node's processes with it, as losing a machine would. Under the rlix commands
(env.keep_ray_on_loopback) every node's address is 127.0.0.1 and all of Ray's servers listen
there; the nodes are told apart by their node IDs, never by address.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass

import ray
from ray.cluster_utils import Cluster

#: a node that misses this many health checks of this period is declared dead (Ray's default
#: takes ~30 s); a lost machine should show within seconds here
HEALTH_CHECK_PERIOD_MS = 500
HEALTH_CHECK_FAILURES = 4


@dataclass(frozen=True)
class SimulatedNode:
    node_id: str
    raylet_pid: int
    head: bool
    gpus: int


class SimulatedCluster:
    """`nodes` Ray nodes with `gpus_per_node` fake GPUs and `cpus_per_node` CPUs each."""

    def __init__(self, nodes: int, gpus_per_node: int, cpus_per_node: int) -> None:
        # a session dir of its own: Ray's default one would make every later `ray.init()` on
        # this machine join this cluster while it lives
        self.temp_dir = tempfile.mkdtemp(prefix="rlix-sim-")
        try:
            self.cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": cpus_per_node, "num_gpus": gpus_per_node, "include_dashboard": False,
                "temp_dir": self.temp_dir,
                "_system_config": {"health_check_period_ms": HEALTH_CHECK_PERIOD_MS,
                                   "health_check_failure_threshold": HEALTH_CHECK_FAILURES}})
        except BaseException:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            raise
        try:
            for _ in range(nodes - 1):
                self.cluster.add_node(num_cpus=cpus_per_node, num_gpus=gpus_per_node)
            self.cluster.wait_for_nodes()
        except BaseException:
            self.shutdown()
            raise
        self.gpus_per_node = gpus_per_node

    @property
    def address(self) -> str:
        return self.cluster.address

    def connect(self, **init_args) -> None:
        ray.init(address=self.address, **init_args)

    def nodes(self) -> list[SimulatedNode]:
        """Every node with its raylet's PID (the head first)."""
        out = []
        for node in [self.cluster.head_node, *self.cluster.worker_nodes]:
            raylet = node.all_processes.get("raylet") or []
            pid = raylet[0].process.pid if raylet else 0
            out.append(SimulatedNode(node.node_id, pid, node is self.cluster.head_node, self.gpus_per_node))
        return out

    def shutdown(self) -> None:
        self.cluster.shutdown()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
