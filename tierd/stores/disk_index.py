"""On-disk metadata of the disk store: the block header and the rule of recovery.

One slab directory holds the slab (``tierd-slab.bin``), the index snapshot
(``tierd-index.msgpack``, :mod:`tierd.stores.disk_snapshot`) and the journal
(``tierd-journal.bin``, with ``tierd-journal.old.bin`` while a checkpoint is written:
:mod:`tierd.stores.disk_journal`). This module owns the per-slot block header, the journal's
operations, and the rule that rebuilds a slab's index from its headers when a crash left
no usable snapshot and journal (:func:`reconcile`; :mod:`tierd.stores.disk_open` decides
when). The header is the truth about bytes; the snapshot and journal are the truth about
intent (which slots the store invalidated).

Block header (first 4096-byte page of every slot, little-endian; data follows at +4096)::

    magic "TIERDBLK" | version u16 | key_len u16 | flags u32 | slot u64 | gen u64
    | data_len u64 | data_xxh3 u64 | key 64s | header_xxh3 u64 (over all bytes before it)
"""

from __future__ import annotations

import enum
import os
import struct
from dataclasses import dataclass

import xxhash

from tierd.stores.disk_entries import Entry, SlotIndex
from tierd.stores.disk_snapshot import Snapshot, load_snapshot, save_snapshot

__all__ = [
    "HEADER_BYTES",
    "BlockHeader",
    "Entry",
    "SlotIndex",
    "Op",
    "Record",
    "Snapshot",
    "data_checksum",
    "load_snapshot",
    "reconcile",
    "save_snapshot",
]

_HDR = struct.Struct("<8sHHIQQQQ64s")
HEADER_BYTES = _HDR.size + 8
_BLOCK_MAGIC = b"TIERDBLK"
_U64 = struct.Struct("<Q")
_VERSION = 1  # of the block header


def _xxh(data: bytes | memoryview) -> int:
    return int(xxhash.xxh3_64_intdigest(data))


def data_checksum(data: memoryview) -> int:
    return _xxh(data)


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """What a slot's header page says about the block behind it."""

    slot: int
    gen: int
    key: bytes
    data_len: int
    data_xxh3: int

    def pack_into(self, page: memoryview) -> None:
        _HDR.pack_into(
            page, 0, _BLOCK_MAGIC, _VERSION, len(self.key), 0, self.slot, self.gen,
            self.data_len, self.data_xxh3, self.key,
        )  # fmt: skip
        _U64.pack_into(page, _HDR.size, _xxh(page[: _HDR.size]))

    @classmethod
    def unpack(cls, page: memoryview) -> BlockHeader | None:
        """The header in ``page``, or None when its magic, version or checksum is wrong
        (never written, torn, or overwritten by something else)."""
        fields = _HDR.unpack_from(page, 0)
        if fields[0] != _BLOCK_MAGIC or fields[1] != _VERSION or fields[2] > 64:
            return None
        if _U64.unpack_from(page, _HDR.size)[0] != _xxh(page[: _HDR.size]):
            return None
        _, _, key_len, _, slot, gen, data_len, csum, key = fields
        return cls(slot, gen, bytes(key[:key_len]), data_len, csum)


class Op(enum.IntEnum):
    BEGIN = 1  # a write to the slot started; its old contents are gone
    SET = 2  # the write finished; the slot holds (key, gen)
    DEL = 3  # the slot was invalidated (or its write failed) up to generation gen


Record = tuple[Op, int, bytes]  # (op, gen, key) for one slot


# -- recovery --------------------------------------------------------------------------


def reconcile(
    known: dict[int, Record], headers: dict[int, BlockHeader]
) -> tuple[dict[int, Entry], dict[int, BlockHeader]]:
    """Split the slots whose header is intact into (trusted, to verify).

    Trusted: the journal's last word on the slot is SET with the header's generation (the
    data was durable before that record was written). Dropped: the last word is DEL at or
    after the header's generation (invalidated, or its write failed). Everything else (a
    write in flight at the crash, a lost journal tail, no journal) must have its data
    checksum verified before the block is readable again.
    """
    trusted: dict[int, Entry] = {}
    verify: dict[int, BlockHeader] = {}
    for slot, hdr in headers.items():
        rec = known.get(slot)
        if rec is not None and rec[0] is Op.SET and rec[1] == hdr.gen and rec[2] == hdr.key:
            trusted[slot] = (hdr.key, hdr.gen)
        elif rec is not None and rec[0] is Op.DEL and rec[1] >= hdr.gen:
            continue
        else:
            verify[slot] = hdr
    return trusted, verify


def private(fd: int) -> None:
    """Make a file of the disk tier readable and writable by its owner only: cached
    blocks reveal the prompts they came from, and an older tierd created them 0644."""
    if os.fstat(fd).st_mode & 0o077:
        os.fchmod(fd, 0o600)
