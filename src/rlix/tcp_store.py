"""torch.distributed's TCPStore rendezvous, its server listening on the address it is given.

A TCPStore server made from a host and a port listens on every interface whatever the host (the
host only tells clients where to connect): the rendezvous of a data-parallel step or a weight
broadcast would then be open to other machines while it lasts. `serve_store` binds the socket to
the host itself (127.0.0.1 on one machine, the node's address when ranks span nodes) and hands
it to the store (`master_listen_fd`); `join_store` is the clients' side.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


def serve_store(host: str, port: int, world_size: int, timeout_s: float, *,
                wait_for_workers: bool = True) -> dist.TCPStore:
    """The server side of a rendezvous on `host`:`port` (port 0: a free one, the store's `port`
    says which), listening there alone. `world_size` counts this process; with
    `wait_for_workers` the call returns once the others have connected (or fails after
    `timeout_s`)."""
    sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        store = dist.TCPStore(host, sock.getsockname()[1], world_size, is_master=True,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=wait_for_workers,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the socket now and closes it when it goes
    return store


def join_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A client of the rendezvous `serve_store` made at `host`:`port` (it retries until the
    server listens, up to `timeout_s`)."""
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
