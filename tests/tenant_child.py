"""A client of another user, for the tenant tests: run as root, it imports what it needs,
drops to ``UID``/``GID`` (no supplementary groups) and then runs a plan of steps against
the daemon, printing one JSON result per step.

Usage: ``python tenant_child.py UID GID SOCKET PLAN`` where PLAN is a JSON list of steps:

- ``{"do": "connect", "namespace": NS}``: connect (mapping the pool); ``tenant``, ``pool``
- ``{"do": "store", "keys": [...], "fill": N}``: blocks of byte N; how many were stored
- ``{"do": "load", "keys": [...]}``: the byte each loaded block is made of ("mixed" if none)
- ``{"do": "lookup" | "get", "keys": [...]}``: how many leading blocks were found
- ``{"do": "op", "name": OP, "fields": {...}}``: a control operation (stats, clear, flush,
  stop, config, metrics, namespaces, delete, ...) with its fields (``keys``, ``key`` and
  ``prefix`` given as text): its reply, or its error code
- ``{"do": "scribble"}``: write 0xEE over every byte of the mapped pool; the pool's inode
- ``{"do": "peek", "pid": PID, "paths": [...]}``: try to open the daemon's descriptors
  (``/proc/PID/fd/*``, ``/proc/PID/map_files/*``) and ``paths``; list tierd's /dev/shm files
- ``{"do": "flood", "count": N, "batch": B, "fill": X}``: store N blocks as fast as it
  can (B per request); stored and refused counts
- ``{"do": "region", "blocks": N, "fill": X}``: a memfd of N blocks of byte X, registered
  as a region; its id
- ``{"do": "describe", "keys": [...], "hashes": [...]}``: describe key i as one 4-token
  engine block of hash ``hashes[i]``; how many descriptions were kept
- ``{"do": "events", "endpoint": E, "wait_ms": T}``: subscribe to a KV-event stream (an
  ``ipc://`` path is first tried as a plain Unix socket: its error, if any) and read for
  ``T`` ms; the engine block hashes of the ``BlockStored`` events heard
- ``{"do": "region_store" | "region_load", "region": R, "keys": [...], "rows": [...]}``:
  the job, key i at block row ``rows[i]`` of the region; per key, False or (a load) the
  byte the row is made of afterwards

A step that fails with a daemon error gives ``{"error": CODE, "message": ...}``.
"""

from __future__ import annotations

import asyncio
import errno
import glob
import json
import mmap
import os
import socket
import sys
import time
from typing import Any

import msgpack
import numpy  # noqa: F401  (regions import it when used: as root, before dropping to UID)
import zmq

from tierd.client import Client, DaemonError, Unreachable

REGIONS: dict[int, int] = {}  # region id -> this process's memfd


def key(name: str) -> bytes:
    return name.encode()


def made_of(block: bytes) -> str:
    return f"{block[0]:02x}" if block and block.count(block[0]) == len(block) else "mixed"


def pool_inode() -> int:
    """The inode of this process's memfd mapping (the pool), from /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "/memfd:" in line:
                return int(line.split()[4])
    return -1


def try_open(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    os.close(fd)
    return True


async def step(client: Client | None, socket_path: str, plan: dict[str, Any]) -> Any:
    do = plan["do"]
    if do == "peek":
        pid = plan["pid"]
        names = glob.glob(f"/proc/{pid}/fd/*") + glob.glob(f"/proc/{pid}/map_files/*")
        listing_denied = not os.access(f"/proc/{pid}/fd", os.R_OK)
        opened = [p for p in [*names, *plan.get("paths", [])] if try_open(p)]
        shm = [os.path.basename(p) for p in glob.glob("/dev/shm/tierd*")]
        return {"opened": opened, "listing_denied": listing_denied, "shm": shm}
    if do == "events":
        return heard(plan["endpoint"], plan["wait_ms"])  # blocking: this process waits only on it
    assert client is not None, "connect first"
    keys = [key(k) for k in plan.get("keys", [])]
    if do == "store":
        return await client.store(keys, [bytes([plan["fill"]]) * client.block_bytes] * len(keys))
    if do == "load":
        return [made_of(b) for b in await client.load(keys)]
    if do == "lookup":
        return (await client.lookup(keys)).count
    if do == "get":
        return len(await client.get(keys))
    if do == "op":
        fields = dict(plan.get("fields", {}))
        for name in ("keys", "key", "prefix"):  # JSON has no bytes: text stands for them
            if name in fields:
                value = fields[name]
                fields[name] = [key(v) for v in value] if isinstance(value, list) else key(value)
        reply = await client.request(plan["name"], **fields)
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}
    if do == "describe":
        described = [
            {"hashes": [h], "parent": None, "tokens": [1, 2, 3, 4], "block_size": 4}
            for h in plan["hashes"]
        ]
        return await client.describe(keys, described)
    if do == "scribble":
        pool = client.require_pool()
        view = pool._view  # the whole mapping, every slot and the gaps between
        view[:] = b"\xee" * len(view)
        return pool_inode()
    if do in ("region", "region_store", "region_load"):
        return await region_step(client, plan)
    if do == "flood":
        stored = refused = 0
        for start in range(0, plan["count"], plan["batch"]):
            names = [key(f"flood-{i}") for i in range(start, start + plan["batch"])]
            try:
                block = bytes([plan["fill"]]) * client.block_bytes
                stored += await client.store(names, [block] * len(names))
            except DaemonError:
                refused += 1
        return {"stored": stored, "refused": refused}
    raise SystemExit(f"unknown step {do!r}")


def heard(endpoint: str, wait_ms: int) -> Any:
    if endpoint.startswith("ipc://"):
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(endpoint[len("ipc://") :])
        except OSError as exc:
            return {"error": errno.errorcode.get(exc.errno or 0, str(exc))}
        finally:
            probe.close()
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        hashes: list[Any] = []
        deadline = time.monotonic() + wait_ms / 1000
        while (left := deadline - time.monotonic()) > 0:
            if sub.poll(int(left * 1000) + 1):
                for event in msgpack.unpackb(sub.recv_multipart()[2])[1]:
                    if event.get("type") == "BlockStored":
                        hashes += event["block_hashes"]
        return {"stored": hashes}
    finally:
        ctx.destroy(linger=0)


async def region_step(client: Client, plan: dict[str, Any]) -> Any:
    size = client.block_bytes
    if plan["do"] == "region":
        fd = os.memfd_create("tenant-region", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, plan["blocks"] * size)
        os.pwrite(fd, bytes([plan["fill"]]) * plan["blocks"] * size, 0)
        region = await client.register_region(fd, plan["blocks"] * size)
        REGIONS[region] = fd
        return region
    keys = [key(k) for k in plan["keys"]]
    offsets = [[row * size] for row in plan["rows"]]
    if plan["do"] == "region_store":
        return await client.region_store(plan["region"], keys, offsets)
    done = await client.region_load(plan["region"], keys, offsets)
    fd = REGIONS[plan["region"]]
    return [
        made_of(os.pread(fd, size, row * size)) if ok else False
        for ok, row in zip(done, plan["rows"], strict=True)
    ]


async def run(socket_path: str, plans: list[dict[str, Any]]) -> list[Any]:
    results: list[Any] = []
    client: Client | None = None
    try:
        for plan in plans:
            try:
                if plan["do"] == "connect":
                    if client is not None:
                        await client.close()
                    client = await Client.connect(socket_path, namespace=plan.get("namespace"))
                    results.append({"tenant": client.info.get("tenant"), "pool": bool(client.pool)})
                else:
                    results.append(await step(client, socket_path, plan))
            except DaemonError as exc:
                results.append({"error": exc.code, "message": str(exc)})
            except Unreachable as exc:
                results.append({"error": "unreachable", "message": str(exc)})
    finally:
        if client is not None:
            await client.close()
    return results


def main() -> None:
    uid, gid, socket_path, plan = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    assert mmap  # imported before the drop, like everything else the plan needs
    # The interpreter's own files may not be readable by the user dropped to: make the
    # loop (and what it imports) first.
    loop = asyncio.new_event_loop()
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    try:
        print(json.dumps(loop.run_until_complete(run(socket_path, json.loads(plan)))))
    finally:
        loop.close()


if __name__ == "__main__":
    main()
