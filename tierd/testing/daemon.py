"""A whole daemon for tests: a small config (:func:`daemon_config`), a socket path short
enough for a Unix socket (:func:`short_socket_path`), and the daemon run in the test's own
event loop until the block exits (:func:`running_daemon`)."""

from __future__ import annotations

import asyncio
import atexit
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierd.daemon import Daemon

__all__ = ["daemon_config", "running_daemon", "short_socket_path"]


def short_socket_path() -> str:
    """A fresh socket path under /tmp: pytest's tmp_path can exceed the 107-byte limit
    of a Unix socket path. The directory is removed when the process exits."""
    directory = tempfile.mkdtemp(prefix="tierd-", dir="/tmp")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return str(Path(directory) / "tierd.sock")


def daemon_config(
    tmp_path: Path,
    *,
    cpu_blocks: int = 8,
    disk_blocks: int | None = 64,
    block_bytes: int = 4096,
    socket_path: str | None = None,
    **sections: Any,
) -> dict[str, Any]:
    """A small daemon config: a cpu tier over an optional disk tier in ``tmp_path``."""
    tiers: list[dict[str, Any]] = [{"name": "cpu", "kind": "cpu", "capacity": cpu_blocks}]
    if disk_blocks is not None:
        directory = tmp_path / "disk"
        directory.mkdir(mode=0o700, exist_ok=True)
        tiers.append(
            {
                "name": "disk",
                "kind": "disk",
                "capacity": disk_blocks,
                "directories": [str(directory)],
            }
        )
    socket = {"path": socket_path or short_socket_path(), **sections.pop("socket", {})}
    # A test tier of a few blocks is often filled by one lease: the default bounds on
    # leases (a share of the entry tier) are tested where they are meant.
    limits = {**_WHOLE_TIER_LEASES, **sections.pop("limits", {})}
    return {
        "block_bytes": block_bytes,
        "tiers": tiers,
        "socket": socket,
        "limits": limits,
        **sections,
    }


_WHOLE_TIER_LEASES = {"lease_blocks_per_connection": "100%", "lease_blocks_per_tenant": "100%"}


@asynccontextmanager
async def running_daemon(config: Any) -> AsyncIterator[Daemon]:
    """Run a daemon (config: a ``DaemonConfig`` or a mapping) in this event loop until
    the block exits, then stop it as SIGTERM would and check it exited 0."""
    from tierd.config import DaemonConfig
    from tierd.daemon import Daemon

    cfg = config if isinstance(config, DaemonConfig) else DaemonConfig.model_validate(config)
    daemon = Daemon(cfg, handle_signals=False)
    task = asyncio.create_task(daemon.run())
    ready = asyncio.create_task(daemon.ready.wait())
    await asyncio.wait([task, ready], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        ready.cancel()
        await task  # raises why it could not start
        raise RuntimeError("the daemon exited before it was ready")
    try:
        yield daemon
    finally:
        daemon.request_stop()
        status = await task
    if status != 0:
        raise RuntimeError(f"the daemon exited with status {status}")
