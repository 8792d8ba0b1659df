"""One daemon, several block sizes (``block_sizes``): each size in its own share of every
tier, chosen by the block size a client's hello names, opened when first named, kept
through a restart, and reported by size in ``stats``. Real daemon processes and sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_kit import Spawn

from tierd.client import Client, DaemonError
from tierd.config import DaemonConfig, size_class_chain
from tierd.errors import ConfigError
from tierd.testing import daemon_config

NAMESPACE = "sizes"
SMALL, LARGE = 4096, 16384  # a vLLM-like row and an SGLang-like page, say


def payload(key: bytes, size: int) -> bytes:
    """Bytes that name their key and size: a block served at the wrong size or from the
    other size's store could not match."""
    stamp = key + b"@" + str(size).encode() + b";"
    return (stamp * (size // len(stamp) + 1))[:size]


def sized_config(tmp_path: Path, **extra: object) -> dict[str, object]:
    # Base size 4096: cpu 16 blocks, disk 64 blocks; two classes: each half of each tier.
    return daemon_config(tmp_path, cpu_blocks=16, disk_blocks=64, block_sizes=2, **extra)


async def connect(path: str, size: int) -> Client:
    return await Client.connect(path, namespace=NAMESPACE, block_bytes=size)


async def test_two_sizes_share_one_daemon_each_at_its_own_size_through_a_restart(
    tmp_path: Path,
    spawn: Spawn,
) -> None:
    config = sized_config(tmp_path)
    daemon = await spawn(config)
    names = [f"k{i}".encode() for i in range(6)]  # the same keys at both sizes
    small = await connect(daemon.socket_path, SMALL)
    large = await connect(daemon.socket_path, LARGE)
    async with small, large:
        assert (small.block_bytes, large.block_bytes) == (SMALL, LARGE)
        assert small.pool is not None and large.pool is not None
        assert await small.store(names, [payload(k, SMALL) for k in names]) == 6
        assert await large.store(names[:2], [payload(k, LARGE) for k in names[:2]]) == 2
        # Each size sees its own blocks only, whole, at its own size.
        assert await small.load(names) == [payload(k, SMALL) for k in names]
        assert await large.load(names[:2]) == [payload(k, LARGE) for k in names[:2]]
        assert (await large.lookup(names)).count == 2
        stats = await small.stats()
        metrics = await small.metrics()
        rows = (await small.namespaces())["default"]
        in_stats = (await small.stats(namespaces=True))["tenants"]["default"]["namespaces"]
    # A namespace's blocks and bytes add up over its sizes, in both requests.
    for found in (rows, in_stats):
        (row,) = [r for r in found if r["namespace"] == NAMESPACE]
        assert row["blocks"]["cpu"] == 8 and row["bytes"] == 6 * SMALL + 2 * LARGE
    labels = f'block_bytes="{LARGE}",tenant="default",tier="cpu"'
    assert f"tierd_block_size_used_blocks{{{labels}}} 2.0" in metrics
    assert f"tierd_block_size_capacity_blocks{{{labels}}} 2.0" in metrics
    by_size = stats["tenants"]["default"]["block_sizes"]
    assert set(by_size) == {str(SMALL), str(LARGE)}
    # Equal byte shares of each tier: 8 of 16 cpu blocks at 4096, 32 KiB / 16 KiB = 2.
    caps = {size: [t["capacity"] for t in part["tiers"]] for size, part in by_size.items()}
    assert caps == {str(SMALL): [8, 32], str(LARGE): [2, 8]}
    stored = {size: part["tiers"][0]["stores"] for size, part in by_size.items()}
    assert stored == {str(SMALL): 6, str(LARGE): 2}
    assert [t["capacity"] for t in stats["tiers"]] == [10, 40]  # added up
    assert stats["tenants"]["default"]["block_bytes"] == SMALL  # the configured size
    command = [sys.executable, "-m", "tierd", "stats", "--socket", daemon.socket_path]
    done = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=60, check=True
    )
    shown = done.stdout
    size_rows = [line.split() for line in shown.splitlines() if line.startswith("default ")]
    assert [row[:3] for row in size_rows] == [["default", "4", "KiB"], ["default", "16", "KiB"]]
    assert size_rows[1][3:5] == ["2/2", "0/8"]  # the large size: cpu full, disk not yet
    recorded = json.loads((tmp_path / "disk" / "block_sizes.json").read_text())
    assert recorded == {"block_sizes": [LARGE]}
    assert (tmp_path / "disk" / f"blocks-{LARGE}").is_dir()
    assert await daemon.stop() == 0

    again = await spawn(config)  # the large size opens at start, with its blocks
    async with await connect(again.socket_path, LARGE) as large:
        assert await large.load(names[:2]) == [payload(k, LARGE) for k in names[:2]]
        async with await connect(again.socket_path, SMALL) as small:
            assert await small.load(names) == [payload(k, SMALL) for k in names]
            stats = await small.stats()
    assert set(stats["tenants"]["default"]["block_sizes"]) == {str(SMALL), str(LARGE)}
    assert "block size opened" in again.stderr()
    assert await again.stop() == 0

    # Back to one size: the other is not opened, and the log says where its slab is.
    single = await spawn({**config, "block_sizes": 1})
    with pytest.raises(DaemonError, match="block_sizes: 2"):
        await connect(single.socket_path, LARGE)
    assert await single.stop() == 0
    assert "block sizes served before are not opened" in single.stderr()
    assert any((tmp_path / "disk" / f"blocks-{LARGE}").iterdir())  # its slab, kept


async def test_a_size_past_the_limit_is_refused_with_what_to_change(
    tmp_path: Path,
    spawn: Spawn,
) -> None:
    daemon = await spawn(sized_config(tmp_path))
    async with await connect(daemon.socket_path, LARGE):
        with pytest.raises(DaemonError, match=r"2 block sizes at most \(block_sizes\)") as third:
            await connect(daemon.socket_path, 32768)
        # A tiny size would cost the daemon a block's bookkeeping per few bytes of share.
        with pytest.raises(DaemonError, match=r"below the smallest .* \(limits.min_block_bytes"):
            await connect(daemon.socket_path, 8192)
    assert third.value.code == "block_size_mismatch"
    # A size no share of a tier can hold one block of: refused, naming the tier.
    (tmp_path / "tight").mkdir()
    tight = sized_config(tmp_path / "tight")
    tight["tiers"][0]["capacity"] = 4  # type: ignore[index]
    other = await spawn(tight)
    with pytest.raises(DaemonError, match=r"tier 'cpu'.* holds no block of 16384") as large:
        await connect(other.socket_path, LARGE)
    assert large.value.code == "block_size_mismatch"
    async with await connect(other.socket_path, SMALL) as small:  # still serving
        assert await small.store([b"x"], [payload(b"x", SMALL)]) == 1
    assert await other.stop() == 0
    assert await daemon.stop() == 0


async def test_one_size_refuses_another_and_says_how_to_serve_several(
    tmp_path: Path,
    spawn: Spawn,
) -> None:
    daemon = await spawn(daemon_config(tmp_path))
    with pytest.raises(DaemonError, match=r"does not match the daemon's 4096.*block_sizes: 2"):
        await connect(daemon.socket_path, LARGE)
    assert not (tmp_path / "disk" / "block_sizes.json").exists()
    assert await daemon.stop() == 0


async def test_clients_naming_a_new_size_at_once_get_one_chain(
    tmp_path: Path,
    spawn: Spawn,
) -> None:
    daemon = await spawn(sized_config(tmp_path))
    clients = await asyncio.gather(*(connect(daemon.socket_path, LARGE) for _ in range(4)))
    try:
        key = b"shared"
        assert await clients[0].store([key], [payload(key, LARGE)]) == 1
        for client in clients:  # one chain: every connection sees the one block
            assert await client.load([key]) == [payload(key, LARGE)]
        stats = await clients[0].stats()
    finally:
        for client in clients:
            await client.close()
    assert set(stats["tenants"]["default"]["block_sizes"]) == {str(SMALL), str(LARGE)}
    assert daemon.stderr().count("block size opened") == 1
    assert await daemon.stop() == 0


def test_a_size_class_is_an_equal_share_of_every_tier_in_its_own_place(tmp_path: Path) -> None:
    cfg = DaemonConfig.model_validate(sized_config(tmp_path))
    own = size_class_chain(cfg, SMALL, 2)
    assert [t.capacity for t in own.tiers] == [8, 32]
    assert own.tiers[1].directories == [tmp_path / "disk"]  # the configured size's slab
    other = size_class_chain(cfg, LARGE, 2)
    assert other.block_bytes == LARGE
    assert [t.capacity for t in other.tiers] == [2, 8]
    assert other.tiers[1].directories == [tmp_path / "disk" / f"blocks-{LARGE}"]
    assert other.tiers[0].shm_name != own.tiers[0].shm_name
    with pytest.raises(ConfigError, match="holds no block of 65536"):
        size_class_chain(cfg, 65536, 2)
    # A size that is not a whole number of pages takes whole pages in every store: its
    # share of memory is never overrun (8 x 4 KiB share: 2 slots of 12 KiB, not 2.67).
    assert [t.capacity for t in size_class_chain(cfg, 8192 + 1, 2).tiers] == [2, 10]


async def test_a_new_sizes_pool_is_allocated_while_the_daemon_answers_others(
    tmp_path: Path,
    spawn: Spawn,
) -> None:
    """Opening a size allocates and populates its share of the CPU tier (256 MiB here):
    on the loop, every other client waited for it. A bystander's health requests, one
    after the other, must be answered while the new size's hello is under way."""
    config = daemon_config(tmp_path, cpu_blocks=512, disk_blocks=None, block_sizes=2)
    config["block_bytes"] = 1 << 20  # a CPU tier of 512 MiB: 256 MiB a size
    daemon = await spawn(config)
    async with await Client.connect(daemon.socket_path) as bystander:
        hello = asyncio.create_task(connect(daemon.socket_path, 256 << 10))
        answered_meanwhile = 0
        for _ in range(100_000):  # bounded; ends with the hello
            await bystander.health()
            if hello.done():
                break
            answered_meanwhile += 1
        async with await hello as large:
            assert large.block_bytes == 256 << 10
    assert answered_meanwhile >= 5, answered_meanwhile
    assert await daemon.stop() == 0


async def test_a_tenants_sizes_live_in_its_own_directory(
    tmp_path: Path,
    spawn: Spawn,
) -> None:
    tenants = [{"name": "team-a", "uids": [os.getuid()], "operator": True}]
    daemon = await spawn(sized_config(tmp_path, tenants=tenants))
    async with await connect(daemon.socket_path, LARGE) as large:
        assert large.info["tenant"] == "team-a" and large.info["block_sizes"] == 2
        assert await large.store([b"t"], [payload(b"t", LARGE)]) == 1
    own = tmp_path / "disk" / "team-a"
    assert json.loads((own / "block_sizes.json").read_text()) == {"block_sizes": [LARGE]}
    assert (own / f"blocks-{LARGE}").is_dir()
    assert not (tmp_path / "disk" / f"blocks-{LARGE}").exists()
    assert await daemon.stop() == 0


async def test_a_size_that_cannot_be_recorded_is_served_all_the_same(
    tmp_path: Path,
    spawn: Spawn,
) -> None:
    daemon = await spawn(sized_config(tmp_path))
    (tmp_path / "disk" / "block_sizes.json").mkdir()  # the record cannot replace it
    async with await connect(daemon.socket_path, LARGE) as large:
        assert await large.store([b"r"], [payload(b"r", LARGE)]) == 1
    async with await connect(daemon.socket_path, LARGE) as again:  # one chain, still
        assert await again.load([b"r"]) == [payload(b"r", LARGE)]
    assert "cannot record the block sizes served" in daemon.stderr()
    assert daemon.stderr().count("block size opened") == 1
    assert await daemon.stop() == 0


async def test_a_size_opens_to_its_end_when_the_client_that_named_it_is_gone(
    tmp_path: Path,
    spawn: Spawn,
) -> None:
    config = daemon_config(tmp_path, cpu_blocks=512, disk_blocks=None, block_sizes=2)
    config["block_bytes"] = 1 << 20  # 256 MiB a size: its pool takes a while to make
    daemon = await spawn(config)
    first = asyncio.create_task(connect(daemon.socket_path, 256 << 10))
    await asyncio.sleep(0.01)
    first.cancel()  # the client gives up, its socket closed, while the pool is made
    with contextlib.suppress(asyncio.CancelledError):
        await first
    async with await connect(daemon.socket_path, 256 << 10) as again:
        assert again.block_bytes == 256 << 10
    assert daemon.stderr().count("block size opened") == 1
    assert await daemon.stop() == 0


# Issue 57, item 8: sizes a member opened were never given back, not even across a
# restart, so three throw-away sizes locked the tenant's other engines out of new sizes.
THROWAWAY = (16384, 20480)  # two sizes an engine tried once and left
NEXT = 24576  # a size another engine of the tenant needs later


def three_sizes(tmp_path: Path, idle_s: float) -> dict[str, object]:
    # 48 x 4 KiB of CPU and 96 of disk, in three shares of 64 KiB and 128 KiB.
    return daemon_config(
        tmp_path,
        cpu_blocks=48,
        disk_blocks=96,
        block_sizes=3,
        limits={"block_size_idle_s": idle_s},
    )


async def sizes_open(path: str) -> dict[str, dict[str, object]]:
    async with await Client.connect(path) as operator:
        return dict((await operator.sizes())["default"]["open"])


async def test_a_size_unused_for_a_while_makes_room_for_a_new_one_and_is_gone_after_a_restart(
    tmp_path: Path,
    spawn: Spawn,
) -> None:
    config = three_sizes(tmp_path, idle_s=0.3)
    daemon = await spawn(config)
    for size in THROWAWAY:  # opened one after the other, each used and left
        async with await connect(daemon.socket_path, size) as client:
            assert await client.store([b"t"], [payload(b"t", size)]) == 1
        await asyncio.sleep(0.1)
    assert set(await sizes_open(daemon.socket_path)) == {str(SMALL), *map(str, THROWAWAY)}
    await asyncio.sleep(0.4)  # both unused past limits.block_size_idle_s
    async with await connect(daemon.socket_path, NEXT) as client:  # refused before
        assert client.block_bytes == NEXT
        assert await client.store([b"n"], [payload(b"n", NEXT)]) == 1
        shown = await sizes_open(daemon.socket_path)
        stats = await client.stats()
    # The longest unused made the room; the other stays (nothing else needed it).
    assert set(shown) == {str(SMALL), str(THROWAWAY[1]), str(NEXT)}
    assert shown[str(NEXT)]["connections"] == 1 and shown[str(NEXT)]["unused_s"] is None
    assert shown[str(SMALL)]["configured"] is True
    assert set(stats["tenants"]["default"]["sizes"]["open"]) == set(shown)
    assert not (tmp_path / "disk" / f"blocks-{THROWAWAY[0]}").exists()  # its slab too
    recorded = json.loads((tmp_path / "disk" / "block_sizes.json").read_text())
    assert sorted(recorded["block_sizes"]) == [THROWAWAY[1], NEXT]
    assert "block size given back" in daemon.stderr()
    assert await daemon.stop() == 0

    again = await spawn(config)  # the given-back size is not opened again
    assert set(await sizes_open(again.socket_path)) == {str(SMALL), str(THROWAWAY[1]), str(NEXT)}
    async with await connect(again.socket_path, NEXT) as client:
        assert await client.load([b"n"]) == [payload(b"n", NEXT)]
    assert await again.stop() == 0


async def test_a_size_in_use_or_used_lately_is_never_given_back(
    tmp_path: Path,
    spawn: Spawn,
) -> None:
    daemon = await spawn(three_sizes(tmp_path, idle_s=60))
    held = await connect(daemon.socket_path, THROWAWAY[0])
    try:
        async with await connect(daemon.socket_path, THROWAWAY[1]) as client:
            assert await client.store([b"u"], [payload(b"u", THROWAWAY[1])]) == 1
        # One size in use, the other unused for less than block_size_idle_s: no room.
        with pytest.raises(DaemonError, match=r"block_size_idle_s \(60 s\).*--give-back"):
            await connect(daemon.socket_path, NEXT)
        async with await Client.connect(daemon.socket_path) as operator:
            with pytest.raises(DaemonError, match="in use: 1 connection"):
                await operator.sizes(give_back=THROWAWAY[0])
            with pytest.raises(DaemonError, match="configured block_bytes"):
                await operator.sizes(give_back=SMALL)
            with pytest.raises(DaemonError, match="is not open"):
                await operator.sizes(give_back=NEXT)
        assert await held.store([b"h"], [payload(b"h", THROWAWAY[0])]) == 1
        assert await held.load([b"h"]) == [payload(b"h", THROWAWAY[0])]
    finally:
        await held.close()
    assert set(await sizes_open(daemon.socket_path)) == {str(SMALL), *map(str, THROWAWAY)}
    assert await daemon.stop() == 0


async def test_an_operator_gives_a_size_back_with_its_blocks(
    tmp_path: Path,
    spawn: Spawn,
) -> None:
    daemon = await spawn(three_sizes(tmp_path, idle_s=3600))
    size = THROWAWAY[0]
    async with await connect(daemon.socket_path, size) as client:
        assert await client.store([b"g"], [payload(b"g", size)]) == 1
    command = [sys.executable, "-m", "tierd", "sizes", "--socket", daemon.socket_path]
    done = await asyncio.to_thread(
        subprocess.run,
        [*command, "--give-back", "16KiB"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "1 of 3 block sizes open" in done.stdout and "(configured)" in done.stdout
    assert not (tmp_path / "disk" / f"blocks-{size}").exists()
    async with await connect(daemon.socket_path, size) as client:  # opened anew: empty
        assert (await client.lookup([b"g"])).count == 0
    refused = await asyncio.to_thread(
        subprocess.run,
        [*command, "--give-back", str(SMALL)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1 and "never given back" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert await daemon.stop() == 0


async def test_a_member_sees_its_own_sizes_and_may_not_give_one_back(
    tmp_path: Path,
    spawn: Spawn,
) -> None:
    tenants = [{"name": "team-a", "uids": [os.getuid()], "operator": False}]
    daemon = await spawn({**three_sizes(tmp_path, idle_s=0), "tenants": tenants})
    async with await connect(daemon.socket_path, THROWAWAY[0]) as client:
        assert await client.store([b"m"], [payload(b"m", THROWAWAY[0])]) == 1
    async with await Client.connect(daemon.socket_path) as member:
        shown = await member.sizes()
        assert set(shown) == {"team-a"}
        assert set(shown["team-a"]["open"]) == {str(SMALL), str(THROWAWAY[0])}
        with pytest.raises(DaemonError, match="needs an operator"):
            await member.sizes(give_back=THROWAWAY[0])
    async with await connect(daemon.socket_path, THROWAWAY[0]) as client:  # still there
        assert await client.load([b"m"]) == [payload(b"m", THROWAWAY[0])]
    assert await daemon.stop() == 0


async def test_a_hello_that_waits_past_the_hello_bound_for_its_size_is_told_so(
    tmp_path: Path,
    spawn: Spawn,
) -> None:
    """A hello whose block size takes longer to open than ``limits.hello_timeout_s`` was
    answered "no hello within ..." though it had come: it is now told its size is still
    opening, and finds it open when it asks again."""
    config = daemon_config(
        tmp_path, cpu_blocks=2048, disk_blocks=None, block_sizes=2, limits={"hello_timeout_s": 0.05}
    )
    config["block_bytes"] = 1 << 20  # a CPU tier of 2 GiB: 1 GiB a size, allocated at its hello
    daemon = await spawn(config)
    refusals: list[str] = []
    for _ in range(200):  # bounded: the size opens within a few attempts
        try:
            client = await connect(daemon.socket_path, 256 << 10)
        except DaemonError as exc:
            refusals.append(str(exc))
            continue
        async with client:
            assert client.block_bytes == 256 << 10
        break
    assert any(f"block size {256 << 10} is still opening" in r for r in refusals), refusals
    assert daemon.stderr().count("block size opened") == 1
    assert await daemon.stop() == 0


async def test_serving_a_second_size_keeps_what_the_disk_tier_held(
    tmp_path: Path,
    spawn: Spawn,
) -> None:
    """``block_sizes: 1`` to ``2`` halves the configured size's share of the disk tier: its
    slab shrinks in place and keeps every block whose slot remains (here all of them),
    instead of being formatted afresh."""
    config = {**sized_config(tmp_path), "block_sizes": 1}
    names = [f"d{i}".encode() for i in range(24)]  # over the cpu tier's 16: on disk too
    daemon = await spawn(config)
    async with await connect(daemon.socket_path, SMALL) as small:
        assert await small.store(names, [payload(k, SMALL) for k in names]) == 24
    assert await daemon.stop() == 0  # writes the dirty blocks back to disk

    again = await spawn({**config, "block_sizes": 2})
    async with await connect(again.socket_path, SMALL) as small:
        assert [t["capacity"] for t in (await small.stats())["tiers"]] == [8, 32]
        for at in range(0, len(names), 4):  # 4 at a time: within the lease bound
            part = names[at : at + 4]
            assert await small.load(part) == [payload(k, SMALL) for k in part]
    assert await again.stop() == 0
    assert "disk slab resized" in again.stderr()
