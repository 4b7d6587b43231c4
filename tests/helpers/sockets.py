"""The TCP sockets processes listen on, read from Linux's ``/proc`` (``ss -ltnp`` without ss)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def available() -> bool:
    """Whether this system has the ``/proc`` files ``listening`` reads (Linux)."""
    return Path("/proc/net/tcp").is_file()


def listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """``(pid, address, port)`` of every TCP socket in the LISTEN state that one of ``pids``
    holds, IPv4 and IPv6 (``0.0.0.0`` or ``::`` for every interface)."""
    owners = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                owners[target[8:-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _LISTEN and inode in owners:
                address, port = local.split(":")
                found.append((owners[inode], str(_address(address)), int(port, 16)))
    return sorted(found)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.IPv4Address(words) if len(words) == 4 else ipaddress.IPv6Address(words)


def outside_loopback(found: list[tuple[int, str, int]]) -> list[tuple[int, str, int]]:
    """The sockets of ``found`` that listen on an address other machines can reach."""
    return [s for s in found if not ipaddress.ip_address(s[1]).is_loopback]
