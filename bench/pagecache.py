"""Files written back and dropped from the kernel's page cache, so that the next reads
come from the drive (as tierd's disk tier reads with O_DIRECT): a like-for-like baseline
for engines' file tiers, which otherwise read back what they just wrote from memory."""

from __future__ import annotations

import os
from pathlib import Path


def drop_cached(directory: Path) -> None:
    """Write back and drop from the page cache every file under ``directory`` (these
    files only; nothing else of the machine's cache is touched)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
