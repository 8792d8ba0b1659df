"""Loopback ports and server processes for the kits that start real servers (redis-server,
SeaweedFS): whether a port is free, free port pairs (a port and the one at a fixed offset,
as both servers bind), and a context that starts a server and stops it on exit."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar


class Server(Protocol):
    def start(self) -> Server: ...

    def stop(self) -> None: ...


S = TypeVar("S", bound=Server)


def bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port_pairs(count: int, offset: int, below: int) -> list[int]:
    """``count`` distinct loopback ports under ``below``, each with its port + ``offset``
    free too, no pair overlapping another."""
    rng = random.Random()
    chosen: list[int] = []
    for _ in range(400):
        port = rng.randrange(20000, below)
        clash = {port, port + offset} & {p + d for p in chosen for d in (0, offset)}
        if not clash and bindable(port) and bindable(port + offset):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise RuntimeError(f"no {count} free loopback port pairs (a port and port + {offset})")


@contextmanager
def running(server: S) -> Iterator[S]:
    """``server`` started, and stopped on exit."""
    server.start()
    try:
        yield server
    finally:
        server.stop()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
