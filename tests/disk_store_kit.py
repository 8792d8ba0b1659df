"""A disk store in a directory: opened, written and read in the test's loop, copied as a crash
would leave it, and run in a child process that is killed mid-write."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.disk_crash_child import content, kill_after_acks
from tierd.keys import int_key
from tierd.stores.disk.store import DiskStore

BB = 8192  # a multiple of 4096: caller buffers can be used without staging
FILES = ("tierd-slab.bin", "tierd-index.msgpack", "tierd-journal.bin", "tierd-journal.old.bin")


def block(i: int) -> bytes:
    return content(i, BB)


def store_at(dirs: Path | list[Path], num_blocks: int = 16, **kw: Any) -> DiskStore:
    directories = dirs if isinstance(dirs, list) else [dirs]
    return DiskStore(num_blocks=num_blocks, block_bytes=BB, directories=directories, **kw)


async def put(store: DiskStore, ids: Sequence[int], slots: Sequence[int] | None = None) -> list:
    slots = list(ids) if slots is None else slots
    return await store.write(slots, [int_key(i) for i in ids], [block(i) for i in ids])


async def get(store: DiskStore, slot: int, i: int) -> bytes | None:
    out = bytearray(BB)
    (ok,) = await store.read([slot], [int_key(i)], [out])
    return bytes(out) if ok else None


def crash_copy(src: Path, dst: Path) -> Path:
    """The store's files as they are now, as a kill at this moment would leave them."""
    dst.mkdir()
    for name in FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    return dst


CHILD = Path(__file__).resolve().parent / "disk_crash_child.py"


async def run_child_until_killed(
    dirs: list[Path], num_blocks: int, fsync: str, acks: int
) -> list[int]:
    """Start the writer child, SIGKILL it once it acknowledged ``acks`` blocks; the acks."""
    argv = [sys.executable, str(CHILD), ",".join(map(str, dirs)), str(num_blocks), str(BB)]
    return await kill_after_acks([*argv, fsync], CHILD.parent.parent, acks)
