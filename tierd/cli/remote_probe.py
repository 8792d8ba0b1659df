"""``tierd config check``'s look at the remote levels: does each one's server take a
connection from this machine, within :data:`PROBE_TIMEOUT` seconds?

A remote level that is down does not stop the daemon (its calls miss until the server
answers, docs/remote.md), so an unreachable one is a warning, not an invalid config. Only
a connection is opened and closed again (TCP, or the Unix socket of a ``unix://`` URL):
no command is sent and no credentials are used, so a server that takes the connection
counts as reachable. Every address is tried at once, so the whole look takes at most
about :data:`PROBE_TIMEOUT` seconds. A level with no address of its own (an S3 level on
AWS's endpoint of its region) is not tried.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from tierd.config import RemoteConfig, S3Config

__all__ = ["PROBE_TIMEOUT", "Address", "addresses", "unreachable"]

PROBE_TIMEOUT = 1.0  # seconds per address; a server on the network answers in milliseconds
_DEFAULT_PORTS = {"redis": 6379, "rediss": 6379, "http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class Address:
    """Where one remote level's server is: ``host`` and ``port``, or a Unix ``path``."""

    level: str  # the level's name
    host: str = ""
    port: int = 0
    path: str = ""

    def __str__(self) -> str:
        if self.path:
            return self.path
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def addresses(level: RemoteConfig | S3Config) -> list[Address]:
    """The addresses ``level`` connects to (a cluster's seed nodes: each of them)."""
    if isinstance(level, S3Config):
        return [] if level.endpoint is None else [_from_url(level.name, level.endpoint)]
    if level.url is not None:
        return [_from_url(level.name, level.url)]
    out = []
    for node in level.cluster_nodes or ():
        host, _, port = node.rpartition(":")
        out.append(Address(level.name, host=host.strip("[]"), port=int(port)))
    return out


def unreachable(levels: Sequence[RemoteConfig | S3Config]) -> list[str]:
    """One line per address of ``levels`` that took no connection, saying why."""
    every = [address for level in levels for address in addresses(level)]
    if not every:
        return []
    reasons = asyncio.run(_probe_all(every))
    return [
        f"remote level {address.level!r} at {address} is unreachable: {reason}"
        for address, reason in zip(every, reasons, strict=True)
        if reason is not None
    ]


def _from_url(level: str, url: str) -> Address:
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return Address(level, path=parts.path)
    try:
        port = parts.port or _DEFAULT_PORTS[parts.scheme]
    except ValueError:  # out of range: port 0, which :func:`_probe` says no connection takes
        port = 0
    return Address(level, host=parts.hostname or "localhost", port=port)


async def _probe_all(every: list[Address]) -> list[str | None]:
    return list(await asyncio.gather(*(_probe(address) for address in every)))


async def _probe(address: Address) -> str | None:
    """Why ``address`` took no connection, or None when it did."""
    if not address.path and not address.port:
        return "its URL names no port a connection could be made to"
    try:
        async with asyncio.timeout(PROBE_TIMEOUT):
            if address.path:
                _, writer = await asyncio.open_unix_connection(address.path)
            else:
                _, writer = await asyncio.open_connection(address.host, address.port)
    except TimeoutError:
        return f"no connection within {PROBE_TIMEOUT:g} s"
    except OSError as exc:
        # asyncio's refused connection carries its errno, its own words in strerror; a
        # name that does not resolve carries the resolver's (negative) code and words.
        number = exc.errno or 0
        return (os.strerror(number) if number > 0 else exc.strerror or str(exc)).lower()
    writer.close()
    return None
