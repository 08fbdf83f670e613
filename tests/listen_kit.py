"""Which TCP sockets a set of processes listens on, and on which address: the one copy the test
folders share (Linux: read from /proc, nothing started, no extra tool).

A listening socket's address and port are in /proc/net/tcp and /proc/net/tcp6 (state 0A), keyed
by the socket's inode; a process holds the socket when one of its /proc/PID/fd entries links to
`socket:[inode]`. Reading another user's fds is not allowed: tests look at their own processes.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass

LISTEN = "0A"  # the TCP state code of a listening socket in /proc/net/tcp*


@dataclass(frozen=True)
class Listener:
    pid: int
    address: str  # as Python's ipaddress writes it: 127.0.0.1, ::, ::1, ::ffff:7f00:1
    port: int
    cmdline: str

    @property
    def loopback(self) -> bool:
        """127.0.0.0/8 or ::1, IPv4-mapped 127.x included (a dual-stack socket bound to 127.0.0.1)."""
        addr = ipaddress.ip_address(self.address)
        mapped = getattr(addr, "ipv4_mapped", None)
        return (mapped or addr).is_loopback

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.cmdline}) on {self.address} port {self.port}"


def _address(hex_addr: str) -> str:
    """/proc/net/tcp* writes an address as 32-bit words in host byte order (little-endian here)."""
    raw = bytes.fromhex(hex_addr)
    host_order = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(host_order))


def _listening_inodes() -> dict[str, tuple[str, int]]:
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 here
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == LISTEN:
                addr, port = fields[1].split(":")
                out[fields[9]] = (_address(addr), int(port, 16))
    return out


def _cmdline(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return " ".join(fh.read().decode(errors="replace").replace("\0", " ").split())[:200]
    except OSError:
        return None


def listening_sockets(pids: Iterable[int]) -> list[Listener]:
    """Every TCP socket the processes `pids` listen on now (one that exits meanwhile is left out)."""
    inodes = _listening_inodes()
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours
            continue
        held = set()
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                held.add(link[8:-1])
        if held:
            cmdline = _cmdline(pid) or "?"
            out += [Listener(pid, *inodes[inode], cmdline) for inode in sorted(held)]
    return out


def off_loopback(listeners: Iterable[Listener]) -> list[str]:
    """Each listener reachable from another machine, described (empty: all on loopback)."""
    return [str(s) for s in listeners if not s.loopback]
