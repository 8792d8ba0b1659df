"""Recovering the disk store's index after a crash without reading every slot.

A crash is a real SIGKILL of the writer child (``tests/disk_crash_child.py``) or a copy
of the store's files taken while it is open. What the reopening store reads is counted
through a :class:`~tierd.stores.disk.io.FileIO` that records every ``preadv``.
"""

from __future__ import annotations

import errno
import gc
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
import xxhash
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.disk_crash_child import content
from tests.disk_store_kit import BB, block, crash_copy, get, put, run_child_until_killed
from tests.gc_walk import references_walked
from tierd.keys import int_key
from tierd.stores.disk.index import SlotIndex, take
from tierd.stores.disk.io import FileIO
from tierd.stores.disk.store import DiskStore

SNAPSHOT = "tierd-index.msgpack"


class CountingIO(FileIO):
    """Counts the reads of slab pages (every ``preadv``)."""

    def __init__(self) -> None:
        self.reads = 0

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        self.reads += 1
        return super().preadv(fd, buffers, offset)


def store_at(dirs: Path | list[Path], num_blocks: int, **kw: object) -> DiskStore:
    directories = dirs if isinstance(dirs, list) else [dirs]
    return DiskStore(num_blocks=num_blocks, block_bytes=BB, directories=directories, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("fsync", ["always", "batch", "none"])
async def test_sigkill_recovery_reads_only_the_slots_left_open(tmp_path: Path, fsync: str) -> None:
    # The child writes 4 blocks at a time over 512 slots and checkpoints every few dozen
    # records; killed mid-stream, at most one batch of writes is in flight. Reopening
    # must read that batch at most (plus the superblock and the O_DIRECT probe), not the
    # 512 slots, and lose no acknowledged block whose slot was not being rewritten.
    num_blocks, batch = 512, 4
    acked = await run_child_until_killed([tmp_path], num_blocks, fsync, 700)
    last = {i % num_blocks: i for i in acked}
    io = CountingIO()
    async with store_at(tmp_path, num_blocks, fileio=io) as store:
        reads_at_open = io.reads
        details = store.stats().details
        index = store.index()
        assert reads_at_open <= 3 + batch, f"{reads_at_open} reads at open"
        assert details["recovery"] == ["crash"]
        assert details["recovery_details"][0]["scanned"] is False
        assert details["recovery_details"][0]["verified"] <= batch
        missing = [slot for slot in last if slot not in index]
        assert len(missing) <= batch, f"acknowledged blocks lost: slots {missing}"
        for slot, key in index.items():
            i = int.from_bytes(key, "little")
            assert i % num_blocks == slot and i >= last.get(slot, 0)
            assert await get(store, slot, i) == content(i, BB)


async def test_a_write_in_flight_at_a_checkpoint_survives_a_crash(tmp_path: Path) -> None:
    # The write's BEGIN went to the old journal, its SET would go to the new one: the
    # snapshot between them must say that the slot is open, or a crash loses the block.
    live = tmp_path / "live"
    live.mkdir()
    async with store_at(live, 16, fsync="always") as store:
        await put(store, range(4))
        slab = store._slabs[0]
        gen = slab.begin(5)
        slab.checkpoint_now()
        assert slab.flush_journal(True) == 0
        assert slab.write_chunk([(5, int_key(5), gen, memoryview(block(5)))]) == [0]
        dead = crash_copy(live, tmp_path / "dead")
        slab.commit(5, int_key(5), gen, True)
    async with store_at(dead, 16) as store:
        assert store.index() == {s: int_key(s) for s in (0, 1, 2, 3, 5)}
        assert store.stats().details["recovery_details"][0]["verified"] == 1
        assert await get(store, 5, 5) == block(5)


class CutShort(FileIO):
    """While ``armed``: a full file system, taking the first bytes of a write, then
    refusing the rest with ENOSPC."""

    def __init__(self) -> None:
        self.armed = False
        self.cuts = 0

    def write(self, fd: int, data: bytes) -> int:
        if not self.armed:
            return super().write(fd, data)
        if self.cuts % 2 == 0:
            self.cuts += 1
            return super().write(fd, data[:40])
        self.cuts += 1
        raise OSError(errno.ENOSPC, "no space left on device")


async def test_a_journal_write_cut_short_loses_no_later_record(tmp_path: Path) -> None:
    # A record cut short would end the replay: every block written after it (the space
    # freed) would be lost at a crash. The failed append is cut back off the file.
    live = tmp_path / "live"
    live.mkdir()
    io = CutShort()
    async with store_at(live, 16, fsync="none", fileio=io) as store:
        await put(store, range(4))
        io.armed = True
        assert await put(store, [4]) == [False]  # its BEGIN could not be written
        assert io.cuts >= 2
        io.armed = False
        await put(store, [5, 6])
        await store.sync()
        dead = crash_copy(live, tmp_path / "dead")
    async with store_at(dead, 16) as store:
        assert store.index() == {s: int_key(s) for s in (0, 1, 2, 3, 5, 6)}
        assert store.stats().details["recovery_details"][0]["scanned"] is False
        assert await get(store, 6, 6) == block(6)


async def crashed_after(tmp_path: Path, ids: Sequence[int]) -> Path:
    """A copy of a store's files taken after writing ``ids`` (journal written, no close):
    what a kill at that moment leaves."""
    live = tmp_path / "live"
    live.mkdir()
    async with store_at(live, 16, fsync="none") as store:
        await put(store, ids)
        await store.sync()
        return crash_copy(live, tmp_path / "dead")


async def test_a_crash_restart_goes_on_with_its_journal(tmp_path: Path) -> None:
    # Opening after a crash writes no snapshot (a million-block index would be rewritten
    # before the first block is served): it cuts the journal's torn tail and appends to
    # it. A second crash then finds the blocks of both lives.
    dead = await crashed_after(tmp_path, range(4))
    with (dead / "tierd-journal.bin").open("ab") as f:
        f.write(b"\x02" * 40)  # a record the kill cut short
    snapshot = (dead / SNAPSHOT).read_bytes()
    async with store_at(dead, 16, fsync="none") as store:
        assert (dead / SNAPSHOT).read_bytes() == snapshot
        assert store.index() == {s: int_key(s) for s in range(4)}
        await put(store, [4, 5])
        await store.sync()
        again = crash_copy(dead, tmp_path / "again")
    async with store_at(again, 16) as store:
        assert store.index() == {s: int_key(s) for s in range(6)}
        assert store.stats().details["recovery_details"][0]["scanned"] is False
        assert await get(store, 5, 5) == block(5)


async def test_a_torn_block_the_journal_vouches_for_is_a_miss(tmp_path: Path) -> None:
    # Nothing reads the blocks at a crash restart; the read that serves one checks it.
    dead = await crashed_after(tmp_path, range(6))
    with (dead / "tierd-slab.bin").open("r+b") as f:
        f.seek(4096 + 2 * (4096 + BB) + 4096 + 10)  # block 2's data
        f.write(b"\x00\xff" * 8)
    async with store_at(dead, 16) as store:
        assert 2 in store.index()
        assert await get(store, 2, 2) is None
        assert await get(store, 3, 3) == block(3)
        assert store.stats().details["checksum_failures"] == 1


def _as_version_1(directory: Path) -> None:
    """Rewrite the snapshot in the format earlier releases wrote (version 1)."""
    from tierd.stores.disk.index import load_snapshot

    raw = (directory / SNAPSHOT).read_bytes()
    doc = msgpack.unpackb(raw[8:])
    snap = load_snapshot(str(directory / SNAPSHOT), doc["uuid"])
    assert snap is not None
    flat: list[object] = []
    for slot, (key, gen) in snap.entries.items():
        flat += (slot, key, gen)
    old = {k: doc[k] for k in ("uuid", "epoch", "next_gen", "clean")}
    payload = msgpack.packb({"version": 1, **old, "slots": flat})
    (directory / SNAPSHOT).write_bytes(
        xxhash.xxh3_64_intdigest(payload).to_bytes(8, "little") + payload
    )


async def test_a_slab_of_the_previous_format_reopens(tmp_path: Path) -> None:
    async with store_at(tmp_path, 16) as store:
        await put(store, range(5))
        expected = store.index()
    _as_version_1(tmp_path)
    async with store_at(tmp_path, 16) as store:
        assert store.stats().details["recovery"] == ["clean"]
        assert store.index() == expected
        assert await get(store, 4, 4) == block(4)


async def test_a_crash_under_the_previous_format_scans_once(tmp_path: Path) -> None:
    # A version-1 snapshot does not list the writes in flight: the store reads every
    # slot's header once, as the releases that wrote it did, and writes version 2 after.
    live = tmp_path / "live"
    live.mkdir()
    async with store_at(live, 16, fsync="none") as store:
        await put(store, range(5))
        await store.sync()
        dead = crash_copy(live, tmp_path / "dead")
    _as_version_1(dead)
    async with store_at(dead, 16) as store:
        assert store.stats().details["recovery_details"][0]["scanned"] is True
        assert store.index() == {s: int_key(s) for s in range(5)}
        await put(store, [9])
        again = crash_copy(dead, tmp_path / "again")
    async with store_at(again, 16) as store:
        assert store.stats().details["recovery_details"][0]["scanned"] is False
        assert store.index() == {**{s: int_key(s) for s in range(5)}, 9: int_key(9)}


async def test_a_daemon_killed_under_load_recovers_from_its_journal(tmp_path: Path) -> None:
    # A real daemon over a disk tier of 4096 slots: 600 blocks flushed to disk, more
    # demoted while it dies. The restart rebuilds the index from the snapshot and the
    # journal (no slot scan), checks at most the writes in flight, and serves every
    # flushed block byte for byte.
    from tests.soak_daemon_kit import NS, blocks, make_keys, store_batches, unleashed_daemon
    from tierd.client import Client

    daemon = unleashed_daemon(tmp_path, cpu_blocks=64, disk_blocks=4096)
    durable, later = make_keys("durable", 600), make_keys("later", 200)
    try:
        await daemon.start()
        async with await Client.connect(daemon.socket_path, namespace=NS) as client:
            await store_batches(client, durable, batch=64)
            await client.flush()
            await store_batches(client, later, batch=64)
        await daemon.kill()
        await daemon.start()
        events = [
            json.loads(line)
            for line in daemon.log_path().read_text().splitlines()
            if "rebuilt disk index" in line
        ]
        assert [(e["source"], e["verified"] <= 64) for e in events] == [("journal", True)]
        async with await Client.connect(daemon.socket_path, namespace=NS) as client:
            assert (await client.lookup(durable)).count == len(durable)
            for i in range(0, len(durable), 64):
                part = durable[i : i + 64]
                assert await client.load(part) == blocks(part)
        assert await daemon.stop() == 0
    finally:
        await daemon.kill()
        daemon.cleanup()


async def _hits(client: Any, keys: Sequence[bytes]) -> list[bytes]:
    """The keys a lookup finds, asked one by one (a pending block is a miss)."""
    return [k for k in keys if (await client.lookup([k])).count == 1]


async def test_a_daemon_serves_while_it_adopts_kept_blocks(tmp_path: Path) -> None:
    # Adoption in the background, paced to 40 blocks a second so that it is still running
    # while the test works: the restarted daemon serves lookups and loads of the blocks
    # adopted so far, stores new blocks into free slots only (never a slot whose block
    # waits to be adopted), and a second SIGKILL mid-adoption loses nothing: the third
    # start (adopting at once) serves every block, byte for byte.
    from tests.soak_daemon_kit import NS, blocks, make_keys, store_batches, tier, unleashed_daemon
    from tierd.client import Client

    daemon = unleashed_daemon(tmp_path, cpu_blocks=64, disk_blocks=4096)
    config = daemon.config
    durable, fresh = make_keys("durable", 600), make_keys("fresh", 300)

    def disk_options(**options: int) -> None:
        config["tiers"][1].update(options)
        daemon.config_file.write_text(yaml.safe_dump(config))

    try:
        await daemon.start()
        async with await Client.connect(daemon.socket_path, namespace=NS) as client:
            await store_batches(client, durable, batch=64)
            await client.flush()
        await daemon.kill()
        disk_options(adopt_inline=0, adopt_rate=40)
        await daemon.start()
        async with await Client.connect(daemon.socket_path, namespace=NS) as client:
            assert tier(await client.stats(), "disk")["adopting"] > 0
            adopted: list[bytes] = []
            for _ in range(600):  # bounded: adoption runs at 40 blocks a second
                adopted = await _hits(client, durable[:8])
                if adopted:
                    break
            assert adopted, "no kept block was adopted"
            assert await client.load(adopted) == blocks(adopted)
            await store_batches(client, fresh, batch=64)
            await client.flush()
            assert (await client.lookup(fresh)).count == len(fresh)
            assert await client.load(fresh[-32:]) == blocks(fresh[-32:])
            assert tier(await client.stats(), "disk")["adopting"] > 0
        await daemon.kill()  # mid-adoption
        disk_options(adopt_inline=65536, adopt_rate=0)
        await daemon.start()
        async with await Client.connect(daemon.socket_path, namespace=NS) as client:
            assert tier(await client.stats(), "disk")["adopting"] == 0
            for keys in (durable, fresh):
                assert (await client.lookup(keys)).count == len(keys)
                for i in range(0, len(keys), 64):
                    assert await client.load(keys[i : i + 64]) == blocks(keys[i : i + 64])
        assert await daemon.stop() == 0
    finally:
        await daemon.kill()
        daemon.cleanup()


def followed(store: DiskStore) -> int:
    """The references a collection follows for the store's indexes."""
    return references_walked(*(slab.entries for slab in store._slabs))


async def test_a_collection_never_walks_the_disk_index(tmp_path: Path) -> None:
    # At a million blocks a dict of (key, gen) tuples cost every collection that walked
    # it 30-70 ms of the loop (a full one 65-150 ms), and freezing the daemon's objects
    # did not always spare it: a full collection untracks such a dict once its tuples are
    # untracked, and the next write tracks it again, as a young object. However the index
    # was made (writes, a clean reopen, a crash's journal, a scan) and whatever collection
    # ran, a collection follows a few references for it, not two per block.
    live = tmp_path / "live"
    live.mkdir()
    async with store_at(live, 64, fsync="none") as store:
        await put(store, range(24))
        gc.collect()
        await put(store, [24, 25])
        assert len(store.index()) == 26 and followed(store) <= 4
        await store.sync()
        dead = crash_copy(live, tmp_path / "dead")
    scanned = crash_copy(dead, tmp_path / "scanned")
    for name in (SNAPSHOT, "tierd-journal.bin"):
        (scanned / name).unlink(missing_ok=True)
    for where, how in ((live, "clean"), (dead, "crash"), (scanned, "crash")):
        async with store_at(where, 64, fsync="none") as store:
            assert store.stats().details["recovery"] == [how]
            assert len(store.index()) == 26 and followed(store) <= 4, where.name
            gc.collect()
            await put(store, [30])
            assert followed(store) <= 4, where.name


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["set", "pop", "del"]),
            st.integers(0, 12),
            st.binary(min_size=1, max_size=4),
        ),
        max_size=60,
    )
)
def test_the_slot_index_behaves_as_the_dict_it_replaced(ops: list[tuple[str, int, bytes]]) -> None:
    index, model = SlotIndex(), {}
    for n, (op, slot, key) in enumerate(ops):
        if op == "set":
            index[slot] = model[slot] = (key, n)
        elif op == "pop":
            assert index.pop(slot, None) == model.pop(slot, None)
        elif slot in model:
            del index[slot], model[slot]
        else:
            with pytest.raises(KeyError):
                del index[slot]
        assert index.get(slot) == model.get(slot) and (slot in index) == (slot in model)
    assert list(index.items()) == list(model.items()) and len(index) == len(model)
    assert index == model and SlotIndex.of(model) == index
    part = take(index, range(14))
    assert part.slots.tolist() == sorted(model)
    assert part.gens.tolist() == [model[s][1] for s in sorted(model)]
    assert part.keys == b"".join(model[s][0] for s in sorted(model))
