"""``tierd.client``: the async client of the daemon's control socket.

See :mod:`tierd.control.client` for the full story; this module is the stable import
path for engines::

    from tierd.client import Client
"""

from tierd.control.client import (
    Client,
    DaemonError,
    Flushed,
    LoadLease,
    Lookup,
    PoolMap,
    StoreLease,
    Unreachable,
    UntrustedDaemon,
)

__all__ = [
    "Client",
    "DaemonError",
    "Flushed",
    "LoadLease",
    "Lookup",
    "PoolMap",
    "StoreLease",
    "Unreachable",
    "UntrustedDaemon",
]
