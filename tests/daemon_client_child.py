"""Child process for the daemon lifecycle tests: a client that dies holding leases.

Usage: ``python daemon_client_child.py SOCKET NAMESPACE BLOCK_BYTES``. It stores the block
``held-load``, then reserves ``held-store-0`` and ``held-store-1`` (``prepare_store``, never
committed) and pins ``held-load`` (``prepare_load``, never released), prints ``ready`` and
waits forever. The parent kills it with SIGKILL, so the daemon sees the connection drop
with both leases open.
"""

from __future__ import annotations

import asyncio
import sys

from tierd.client import Client

LOADED = b"held-load"
RESERVED = [b"held-store-0", b"held-store-1"]


async def main(socket_path: str, namespace: str, block_bytes: int) -> None:
    client = await Client.connect(socket_path, namespace=namespace)
    await client.store([LOADED], [bytes([7]) * block_bytes])
    store_lease = await client.prepare_store(RESERVED)
    load_lease = await client.prepare_load([LOADED])
    if store_lease.lease is None or load_lease.lease is None or load_lease.count != 1:
        raise SystemExit(f"expected two open leases, got {store_lease.slots} {load_lease.count}")
    print("ready", flush=True)
    await asyncio.Event().wait()  # hold the leases until killed


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
