"""Test kit shipped with tierd: the block-store conformance suite, store fakes and an
in-loop daemon.

Every :class:`~tierd.stores.BlockStore` must pass :class:`StoreConformance`. A test module
subclasses it and says how to build an *unopened* store::

    class TestMemoryStore(StoreConformance):
        async def make_store(self, num_blocks: int, block_bytes: int) -> BlockStore:
            return MemoryStore(num_blocks=num_blocks, block_bytes=block_bytes)

View checks run only where ``store.has_views`` is true. :class:`FailingStore` wraps a
real store and fails chosen blocks (or holds copies at a gate) for tier and chain tests.
:func:`running_daemon` runs a whole daemon inside the test's event loop, on a real
socket (:func:`daemon_config` builds a small cpu + disk config for it);
:func:`start_daemon` runs one in a child process and returns once it sent ``READY=1``.
It is for tests and benchmarks. The conformance suite needs pytest and torch (the ``test``
and ``gpu`` extras) and is imported on first use of :class:`StoreConformance`, so the rest,
the daemon helpers included, works in any install of tierd (an engine's venv too).

Modules: :mod:`~tierd.testing.conformance` (the suite), :mod:`~tierd.testing.faults`
(stores that fail, bytes flipped on disk), :mod:`~tierd.testing.daemon` (configs, socket
paths, a daemon in the test's loop), :mod:`~tierd.testing.process` (a daemon in a child
process, awaited through sd_notify), :mod:`~tierd.testing.blocks` (keys and block bytes),
:mod:`~tierd.testing.kv_replay` (a KV-event publisher's replay, asked),
:mod:`~tierd.testing.polling` (a bounded wait for a condition).
Import every name from here: ``from tierd.testing import FailingStore``.
"""

from typing import TYPE_CHECKING, Any

from tierd.lazy import lazy_attribute
from tierd.testing.blocks import as_bytes, keys_for, random_blocks
from tierd.testing.daemon import daemon_config, running_daemon, short_socket_path
from tierd.testing.faults import FailingStore, corrupt_disk_block
from tierd.testing.kv_replay import kv_replay
from tierd.testing.polling import poll_until
from tierd.testing.process import (
    DaemonNotReady,
    DaemonProcess,
    DaemonSpec,
    config_check,
    serve_command,
    start_daemon,
    start_daemon_async,
)

if TYPE_CHECKING:
    from tierd.testing.conformance import StoreConformance

__all__ = [
    "DaemonNotReady",
    "DaemonProcess",
    "DaemonSpec",
    "FailingStore",
    "StoreConformance",
    "as_bytes",
    "corrupt_disk_block",
    "daemon_config",
    "keys_for",
    "kv_replay",
    "poll_until",
    "random_blocks",
    "running_daemon",
    "config_check",
    "serve_command",
    "short_socket_path",
    "start_daemon",
    "start_daemon_async",
]


def __getattr__(name: str) -> Any:
    """:class:`StoreConformance` on first use: it imports pytest and torch."""
    return lazy_attribute(__name__, name, {"StoreConformance": "tierd.testing.conformance"})
