"""Recording live traffic: each sampled lookup as one Mooncake-format JSON line.

A lookup is an engine asking which leading blocks of one request are cached, so one
lookup is one request. A :class:`TraceRecorder` appends, per tenant, to
``<directory>/<tenant>.jsonl``::

    {"timestamp": <ms since recording began>, "input_length": <blocks>,
     "output_length": 0, "hash_ids": [<id>, ...], "namespace": "<namespace id, hex>"}

``hash_ids`` are the client's keys (already hashes): an 8-byte key is read back as the
integer it encodes (so a trace replayed by ``tierd replay`` records as itself), a longer
one becomes its xxh3-64. Requests are sampled whole by the xxh3 of their first key, so
every request of a prefix chain is in or out together and a sampled trace's hit-ratio
curve is the curve of that share of the traffic. A file that reaches ``max_bytes`` is
renamed ``<tenant>.jsonl.1`` (older ones shift up, past ``keep`` they are deleted), so a
tenant's recording takes at most ``(keep + 1) * max_bytes``.

Writes go through a buffered file on the event loop's thread: a sampled lookup costs one
``json`` line in memory; the kernel sees a write per 64 KiB. Recording is off unless the
config turns it on; an operator turns it on and off at run time (``trace`` operation).
A failed write turns recording off and is logged, never failing the lookup.

The directory holds every tenant's lookups, so it is checked each time recording starts
(``check_directory``: the daemon passes the disk tiers' check, :mod:`tierd.preflight`):
another user's directory, one its group or others may read, or one named through another
user's link, is refused with :class:`~tierd.errors.ConfigError`. A directory the recorder
creates is 0700, its files 0600 (an existing file is tightened to 0600 when opened).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import xxhash

from tierd.errors import ConfigError
from tierd.logs import get_logger

__all__ = ["RecorderSettings", "TraceRecorder", "hash_id"]

_log = get_logger("tierd.trace")
_SCALE = 1 << 64
_BUFFER = 64 << 10


@dataclass(frozen=True, slots=True)
class RecorderSettings:
    directory: Path
    sample: float = 1.0  # share of requests recorded, 0 < sample <= 1
    max_bytes: int = 64 << 20  # per file, before it rotates
    keep: int = 4  # rotated files kept per tenant


def hash_id(key: bytes) -> int:
    """The trace id of a client key: the integer an 8-byte key encodes, else its xxh3."""
    if len(key) == 8:
        return int.from_bytes(key, "little")
    return int(xxhash.xxh3_64_intdigest(key))


class _File:
    """One tenant's current file and its size."""

    def __init__(self, path: Path) -> None:
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            st = os.fstat(fd)
            if st.st_mode & 0o077:  # left looser by an older daemon, or by hand
                os.fchmod(fd, 0o600)
        except OSError:
            os.close(fd)
            raise
        self.handle: IO[str] = os.fdopen(fd, "a", buffering=_BUFFER, encoding="utf-8")
        self.size = st.st_size


class TraceRecorder:
    """Appends sampled requests to per-tenant JSONL files; see the module docstring."""

    def __init__(
        self,
        settings: RecorderSettings,
        *,
        enabled: bool = False,
        check_directory: Callable[[Path], str | None] = lambda directory: None,
    ) -> None:
        if not 0 < settings.sample <= 1:
            raise ValueError(f"trace sample must be in (0, 1], got {settings.sample}")
        self.settings = settings
        self._check_directory = check_directory  # why a directory is unsafe, or None
        self._limit = int(settings.sample * _SCALE)
        self._files: dict[str, _File] = {}
        self._began = time.monotonic()
        self.enabled = False
        self.recorded = 0
        self.skipped = 0
        self.error = ""
        if enabled:
            self.set_enabled(True)

    def set_enabled(self, on: bool) -> None:
        """Start or stop recording (stopping flushes and closes the files);
        :class:`ConfigError` when the directory is not private to the daemon's user,
        ``OSError`` when it cannot be created."""
        if on and not self.enabled:
            self._refuse_unsafe()  # before anything is created through it
            self.settings.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._refuse_unsafe()
            self._began = time.monotonic()
            self.error = ""
        if not on:
            self.close()
        self.enabled = on
        _log.info("trace recording", enabled=on, directory=str(self.settings.directory))

    def _refuse_unsafe(self) -> None:
        problem = self._check_directory(self.settings.directory)
        if problem is not None:
            raise ConfigError(problem, path="trace.directory")

    def record(self, tenant: str, namespace_id: bytes, keys: Sequence[bytes]) -> None:
        """Record one request (a lookup of ``keys``) if it is sampled."""
        if not self.enabled or not keys:
            return
        if self._limit < _SCALE and xxhash.xxh3_64_intdigest(keys[0]) >= self._limit:
            self.skipped += 1
            return
        line = (
            json.dumps(
                {
                    "timestamp": int((time.monotonic() - self._began) * 1000),
                    "input_length": len(keys),
                    "output_length": 0,
                    "hash_ids": [hash_id(k) for k in keys],
                    "namespace": namespace_id.hex(),
                },
                separators=(",", ":"),
            )
            + "\n"
        )
        try:
            self._write(tenant, line)
        except OSError as exc:
            self.error = f"{exc.strerror or exc}"
            _log.warning("trace recording failed: recording stopped", error=self.error)
            self.set_enabled(False)
            return
        self.recorded += 1

    def _write(self, tenant: str, line: str) -> None:
        f = self._files.get(tenant)
        if f is None:
            f = self._files[tenant] = _File(self.settings.directory / f"{tenant}.jsonl")
        if f.size and f.size + len(line) > self.settings.max_bytes:
            f = self._rotate(tenant, f)
        f.handle.write(line)
        f.size += len(line)

    def _rotate(self, tenant: str, f: _File) -> _File:
        f.handle.close()
        keep = self.settings.keep
        base = str(f.path)
        if keep < 1:
            os.unlink(base)
        else:
            for n in range(keep - 1, 0, -1):
                if os.path.exists(f"{base}.{n}"):
                    os.replace(f"{base}.{n}", f"{base}.{n + 1}")
            os.replace(base, f"{base}.1")
        new = self._files[tenant] = _File(f.path)
        return new

    def flush(self) -> None:
        for f in self._files.values():
            f.handle.flush()

    def close(self) -> None:
        files, self._files = self._files, {}
        for f in files.values():
            try:
                f.handle.close()
            except OSError as exc:
                _log.warning("cannot close a trace file", path=str(f.path), error=str(exc))

    def state(self) -> dict[str, Any]:
        s = self.settings
        return {
            "enabled": self.enabled,
            "directory": str(s.directory),
            "sample": s.sample,
            "max_bytes": s.max_bytes,
            "keep": s.keep,
            "recorded": self.recorded,
            "skipped": self.skipped,
            "error": self.error,
        }
