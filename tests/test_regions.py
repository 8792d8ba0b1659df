"""Engine host regions through a real daemon: an engine's memory (a real memfd, a real
``/dev/shm`` file) handed over once, then stores and loads of (key, offsets) descriptors
that the daemon copies itself.

Round trips are byte-exact with one and two pieces per block; loads are per key; regions
belong to the connection that registered them (other connections and other tenants get
``unknown_region``) and their descriptor is closed when it goes. The hostile cases are in
``tests/test_region_attacks.py``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from redis_kit import redis_server

from tests.loop_daemon_kit import connect_watched, daemon_noticed_close, serve
from tests.regions_kit import (
    BLOCK,
    NS,
    connect,
    memfd,
    open_descriptors,
    pattern,
    put,
    read,
    rows,
    touch,
)
from tierd.client import DaemonError

# The daemon's connections, watched (conftest's fixture).
pytestmark = pytest.mark.usefixtures("_watch_connections")


def write_patterns(fd: int, tag: bytes, count: int) -> list[bytes]:
    """Rows ``0..count`` of ``fd`` filled with ``pattern(tag + i + "-")``; the keys ``tag + i``."""
    for i in range(count):
        put(fd, pattern(b"%s%d-" % (tag, i), BLOCK), i * BLOCK)
    return [b"%s%d" % (tag, i) for i in range(count)]


async def test_one_piece_round_trip_is_byte_exact(tmp_path: Path) -> None:
    async with serve(tmp_path) as daemon, await connect(daemon) as client:
        with memfd(16 * BLOCK) as fd:
            blocks = [os.urandom(BLOCK) for _ in range(6)]
            for i, data in enumerate(blocks):
                put(fd, data, i * BLOCK)
            region = await client.register_region(fd, 16 * BLOCK)
            keys = [f"k{i}".encode() for i in range(6)]
            assert await client.region_store(region, keys, rows(0, 1, 2, 3, 4, 5)) == [True] * 6
            assert await client.lookup_each(keys) == [True] * 6
            # Loaded into other rows, in another order.
            order = [5, 3, 1, 0, 2, 4]
            dest = rows(*(10 + j for j in range(6)))
            done = await client.region_load(region, [keys[i] for i in order], dest)
            assert done == [True] * 6
            for j, i in enumerate(order):
                assert read(fd, (10 + j) * BLOCK) == blocks[i]
            # The same bytes come back through the ordinary lease path.
            assert await client.load(keys[:2]) == blocks[:2]


async def test_two_pieces_per_block_keep_k_and_v_apart(tmp_path: Path) -> None:
    """A page-first layout: a block's K half and V half lie in different places."""
    half = BLOCK // 2
    async with serve(tmp_path) as daemon, await connect(daemon) as client:
        with memfd(64 * half) as fd:
            keys = [b"p0", b"p1", b"p2"]
            # K of page i at half-slot i, V at half-slot 16 + i.
            for i, key in enumerate(keys):
                put(fd, pattern(b"K" + key, half), i * half)
                put(fd, pattern(b"V" + key, half), (16 + i) * half)
            region = await client.register_region(fd, 64 * half)
            table = np.array([[i * half, (16 + i) * half] for i in range(3)], dtype=np.uint64)
            assert await client.region_store(region, keys, table, (half, half)) == [True] * 3
            # A block is K then V, whoever reads it.
            first = await client.load(keys[:1])
            assert first == [pattern(b"Kp0", half) + pattern(b"Vp0", half)]
            # Loaded back into other pages, both pieces land where they are asked to.
            back = np.array([[(32 + i) * half, (48 + i) * half] for i in range(3)], np.uint64)
            assert await client.region_load(region, keys, back, [half, half]) == [True] * 3
            for i, key in enumerate(keys):
                assert read(fd, (32 + i) * half, half) == pattern(b"K" + key, half)
                assert read(fd, (48 + i) * half, half) == pattern(b"V" + key, half)


async def test_loads_are_per_key_and_come_from_every_tier(tmp_path: Path) -> None:
    async with (
        serve(tmp_path, cpu_blocks=4, disk_blocks=32) as daemon,
        await connect(daemon) as client,
    ):
        with memfd(32 * BLOCK) as fd:
            keys = write_patterns(fd, b"blk", 12)
            region = await client.register_region(fd, 32 * BLOCK)
            for start in range(0, 12, 4):  # through a 4-block CPU tier: most go to disk
                part = range(start, start + 4)
                done = await client.region_store(region, keys[start : start + 4], rows(*part))
                assert done == [True] * 4
            assert "DISK" in (await client.lookup(keys)).media
            # Holes: absent keys between present ones; the present ones all load.
            asked = [keys[0], b"absent-1", keys[9], keys[5], b"absent-2", keys[11]]
            dest = rows(*range(16, 22))
            assert await client.region_load(region, asked, dest) == [
                True,
                False,
                True,
                True,
                False,
                True,
            ]
            for j, i in ((0, 0), (2, 9), (3, 5), (5, 11)):
                assert read(fd, (16 + j) * BLOCK) == pattern(b"blk%d-" % i, BLOCK)
            # A missed key's destination is untouched.
            assert read(fd, 17 * BLOCK) == bytes(BLOCK)
            # One key loaded into two places.
            both = await client.region_load(region, [keys[3], keys[3]], rows(24, 25))
            assert both == [True, True]
            assert read(fd, 24 * BLOCK) == read(fd, 25 * BLOCK) == pattern(b"blk3-", BLOCK)


async def test_held_keys_are_not_read_again(tmp_path: Path) -> None:
    async with serve(tmp_path) as daemon, await connect(daemon) as client:
        with memfd(4 * BLOCK) as fd:
            put(fd, pattern(b"first", BLOCK), 0)
            region = await client.register_region(fd, 4 * BLOCK)
            assert await client.region_store(region, [b"k"], rows(0)) == [True]
            put(fd, pattern(b"second", BLOCK), 0)
            assert await client.region_store(region, [b"k"], rows(0)) == [True]
            assert await client.load([b"k"]) == [pattern(b"first", BLOCK)]
            with pytest.raises(DaemonError) as info:  # a store names each key once
                await client.region_store(region, [b"a", b"a"], rows(0, 1))
            assert info.value.code == "bad_request"


async def test_regions_of_one_memfd_on_several_connections_all_load(tmp_path: Path) -> None:
    """One memfd registered by three connections (an engine's threads): the first load
    seals the file, and the others' loads use the daemon's one mapping of it (a new
    writable mapping of a sealed file is refused: each of them was refused loads)."""
    async with serve(tmp_path) as daemon:
        clients = [await connect(daemon) for _ in range(3)]
        try:
            with memfd(8 * BLOCK) as fd:
                put(fd, pattern(b"one", BLOCK), 0)
                regions = [await c.register_region(fd, 8 * BLOCK) for c in clients]
                assert await clients[0].region_store(regions[0], [b"one"], rows(0)) == [True]
                for i, (client, region) in enumerate(zip(clients, regions, strict=True)):
                    assert await client.region_load(region, [b"one"], rows(i + 1)) == [True]
                    assert read(fd, (i + 1) * BLOCK) == pattern(b"one", BLOCK)
                await clients[1].close()  # one region gone: the others keep the mapping
                assert await clients[2].region_load(regions[2], [b"one"], rows(5)) == [True]
        finally:
            for client in clients:
                await client.close()


async def test_a_dev_shm_file_is_a_region_too(tmp_path: Path) -> None:
    path = Path("/dev/shm") / f"tierd-test-region-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 8 * BLOCK)
        touch(fd, 8 * BLOCK)
        put(fd, pattern(b"shm", BLOCK), 0)
        async with serve(tmp_path) as daemon, await connect(daemon) as client:
            region = await client.register_region(fd, 8 * BLOCK)
            assert await client.region_store(region, [b"s"], rows(0)) == [True]
            # A load writes only into a file it can seal (a /dev/shm file cannot be):
            # refused whole, saying why, and the region still serves stores.
            with pytest.raises(DaemonError, match="MFD_ALLOW_SEALING"):
                await client.region_load(region, [b"s"], rows(7))
            assert read(fd, 7 * BLOCK) == bytes(BLOCK)
            assert await client.region_store(region, [b"s2"], rows(0)) == [True]
    finally:
        os.close(fd)
        path.unlink()


async def test_an_entry_tier_without_views_is_staged(tmp_path: Path) -> None:
    """A disk entry tier has no host views: the bytes go through private buffers."""
    async with (
        serve(tmp_path, cpu_blocks=4, disk_blocks=16, entry="disk") as daemon,
        await connect(daemon) as client,
    ):
        with memfd(8 * BLOCK) as fd:
            for i in range(3):
                put(fd, pattern(b"disk%d" % i, BLOCK), i * BLOCK)
            region = await client.register_region(fd, 8 * BLOCK)
            keys = [b"d0", b"d1", b"d2"]
            assert await client.region_store(region, keys, rows(0, 1, 2)) == [True] * 3
            stats = await client.stats()
            assert [t["used"] for t in stats["tiers"]] == [0, 3]
            assert await client.region_load(region, keys, rows(4, 5, 6)) == [True] * 3
            for i in range(3):
                assert read(fd, (4 + i) * BLOCK) == pattern(b"disk%d" % i, BLOCK)


async def test_namespaces_are_kept_apart(tmp_path: Path) -> None:
    async with (
        serve(tmp_path) as daemon,
        await connect(daemon, "model-a") as a,
        await connect(daemon, "model-b") as b,
    ):
        with memfd(4 * BLOCK) as fd_a, memfd(4 * BLOCK) as fd_b:
            put(fd_a, pattern(b"A", BLOCK), 0)
            region_a = await a.register_region(fd_a, 4 * BLOCK)
            region_b = await b.register_region(fd_b, 4 * BLOCK)
            assert await a.region_store(region_a, [b"same"], rows(0)) == [True]
            assert await b.region_load(region_b, [b"same"], rows(1)) == [False]
            assert read(fd_b, BLOCK) == bytes(BLOCK)
            put(fd_b, pattern(b"B", BLOCK), 0)
            assert await b.region_store(region_b, [b"same"], rows(0)) == [True]
            assert await a.region_load(region_a, [b"same"], rows(1)) == [True]
            assert read(fd_a, BLOCK) == pattern(b"A", BLOCK)


async def test_a_region_belongs_to_its_connection(tmp_path: Path) -> None:
    async with (
        serve(tmp_path) as daemon,
        await connect(daemon) as owner,
        await connect(daemon) as other,
    ):
        with memfd(4 * BLOCK) as fd:
            put(fd, pattern(b"mine", BLOCK), 0)
            region = await owner.register_region(fd, 4 * BLOCK)
            for call in (
                lambda: other.region_store(region, [b"x"], rows(0)),
                lambda: other.region_load(region, [b"x"], rows(1)),
                lambda: other.unregister_region(region),
            ):
                with pytest.raises(DaemonError) as info:
                    await call()
                assert info.value.code == "unknown_region"
            assert await owner.region_store(region, [b"x"], rows(0)) == [True]
            await owner.unregister_region(region)
            with pytest.raises(DaemonError) as info:
                await owner.region_load(region, [b"x"], rows(1))
            assert info.value.code == "unknown_region"


async def test_the_descriptor_is_closed_on_unregister_and_disconnect(tmp_path: Path) -> None:
    async with serve(tmp_path) as daemon:
        with memfd(4 * BLOCK, "region-fd-probe") as fd:
            assert open_descriptors("region-fd-probe") == 1  # ours
            client, conn = await connect_watched(daemon, NS)
            region = await client.register_region(fd, 4 * BLOCK)
            assert open_descriptors("region-fd-probe") == 2  # and the daemon's
            await client.unregister_region(region)
            assert open_descriptors("region-fd-probe") == 1
            await client.register_region(fd, 4 * BLOCK)
            await client.register_region(fd, 2 * BLOCK)
            assert open_descriptors("region-fd-probe") == 3
            await client.close()
            await daemon_noticed_close(conn)
            assert open_descriptors("region-fd-probe") == 1


async def test_jobs_over_the_daemons_bounds_are_split_by_the_client(tmp_path: Path) -> None:
    limits = {"max_keys_per_request": 8}
    async with (
        serve(tmp_path, cpu_blocks=64, limits=limits) as daemon,
        await connect(daemon) as client,
    ):
        with memfd(64 * BLOCK) as fd:
            keys = write_patterns(fd, b"big", 20)
            region = await client.register_region(fd, 64 * BLOCK)
            assert await client.region_store(region, keys, rows(*range(20))) == [True] * 20
            assert await client.region_load(region, keys, rows(*range(32, 52))) == [True] * 20
            for i in range(20):
                assert read(fd, (32 + i) * BLOCK) == pattern(b"big%d-" % i, BLOCK)
            with pytest.raises(DaemonError) as info:  # one request over the limit
                await client.request(
                    "region_store", region=region, keys=keys, offsets=rows(*range(20)).tobytes()
                )
            assert info.value.code == "too_many_keys"


async def test_loads_promote_from_the_remote_level(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as redis:
        remote = {"url": redis.url, "deadline": "2s"}
        async with serve(tmp_path, remote=remote) as daemon, await connect(daemon) as client:
            with memfd(16 * BLOCK) as fd:
                for i in range(4):
                    put(fd, pattern(b"far%d-" % i, BLOCK), i * BLOCK)
                region = await client.register_region(fd, 16 * BLOCK)
                keys = [b"far%d" % i for i in range(4)]
                assert await client.region_store(region, keys, rows(0, 1, 2, 3)) == [True] * 4
                await client.flush()  # down to disk, then to the remote level
                async with await connect(daemon, None) as operator:
                    assert await operator.clear() >= 4
                assert await client.lookup_each(keys) == [True] * 4  # remotely only
                asked = [keys[2], b"nowhere", keys[0], keys[3]]
                done = await client.region_load(region, asked, rows(8, 9, 10, 11))
                assert done == [True, False, True, True]
                for j, i in ((0, 2), (2, 0), (3, 3)):
                    assert read(fd, (8 + j) * BLOCK) == pattern(b"far%d-" % i, BLOCK)
                assert (await client.lookup(keys[2:3])).media == ("CPU",)  # promoted


async def test_a_job_its_engine_gave_up_moves_nothing(tmp_path: Path) -> None:
    """A job past its ``expires`` (the engine stopped waiting, as after a frozen daemon's
    deadline, and may have reused the memory) neither stores what it would read nor
    writes into the region; a live job beside it does both."""
    async with serve(tmp_path) as daemon, await connect(daemon) as client:
        with memfd(8 * BLOCK) as fd:
            for i in range(4):
                put(fd, pattern(b"%d" % i, BLOCK), i * BLOCK)
            region = await client.register_region(fd, 8 * BLOCK)
            given_up = time.monotonic() - 1.0
            late = [b"late0", b"late1"]
            assert await client.region_store(region, late, rows(0, 1), expires=given_up) == [
                False,
                False,
            ]
            assert await client.lookup_each(late) == [False, False]
            live = [b"live2", b"live3"]
            in_time = time.monotonic() + 60.0
            assert await client.region_store(region, live, rows(2, 3), expires=in_time) == [
                True,
                True,
            ]
            put(fd, pattern(b"engine", 2 * BLOCK), 4 * BLOCK)  # reused rows 4 and 5
            assert await client.region_load(region, live, rows(4, 5), expires=given_up) == [
                False,
                False,
            ]
            assert read(fd, 4 * BLOCK, 2 * BLOCK) == pattern(b"engine", 2 * BLOCK)
            assert await client.region_load(region, live, rows(6, 7), expires=in_time) == [
                True,
                True,
            ]
            assert read(fd, 6 * BLOCK) == pattern(b"2", BLOCK)
            with pytest.raises(DaemonError) as refused:
                await client.request(
                    "region_load",
                    region=region,
                    keys=live,
                    offsets=rows(4, 5).tobytes(),
                    expires="soon",
                )
            assert refused.value.code == "bad_request"
