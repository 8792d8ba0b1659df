"""The object-store level on an S3-compatible server: one object per block, written
once, verified on every read, requests batched under one deadline, and a circuit breaker.

Objects are named ``<key_prefix>v<format>.<block bytes>/<key in hex>``: daemons with the
same prefix and block size share every block, and daemons that could not read each
other's objects (another format, another block size) never find them. An object is the
value format of :mod:`tierd.remote.values` (magic, version, key, payload length,
xxh3-64 checksum, key, payload), so a wrong, truncated, foreign or oversized object is a
miss, counted ``corrupt`` and deleted (the next write of the block can then store it
again), never bytes served.

- ``present``: a ``HEAD`` per key, sent together; ``exists`` (the leading run) asks in
  growing windows and stops at the first key missing. An object of the wrong size is not
  counted as there.
- ``get``: a ``GET`` per key, sent together; a body longer than a block's value is never
  read.
- ``put``: a ``PUT`` per block with ``If-None-Match: *``: a block is stored once however
  many nodes send it (the server answers ``412`` to the others, counted ``skipped``).

The server keeps the objects; tierd keeps no index of them and never evicts them: the
bucket's lifecycle rules do (docs/remote.md). Faults are misses, never stalls and never
errors to the caller (:class:`~tierd.remote.s3_calls.S3Calls`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tierd.events import EventKind
from tierd.keys import BlockKey, Medium
from tierd.logs import get_logger
from tierd.remote.level import LevelBase, Payload
from tierd.remote.s3_calls import ABSENT, FAILED, HELD, S3Calls, S3Settings
from tierd.remote.values import HEADER_BYTES, VERSION, decode_block, encode_into

__all__ = ["S3Level"]

log = get_logger("tierd.remote")

_FIRST_WINDOW = 4  # keys asked in the first round of an existence check
_WINDOW_GROWTH = 4  # each further round asks this many times more


class _TooBig:
    """A body longer than any block's value: left unread."""

    def __init__(self, size: int) -> None:
        self.size = size


async def _head(store: Any, path: str) -> Any:
    import obstore

    return await obstore.head_async(store, path)


async def _delete(store: Any, path: str) -> Any:
    import obstore

    return await obstore.delete_async(store, path)


class S3Level(LevelBase):
    """A shared level on one S3 bucket. Open with ``open()``."""

    medium = Medium.OBJECT
    calls: S3Calls

    def __init__(self, settings: S3Settings) -> None:
        super().__init__(settings.name, settings.block_bytes, settings.max_pending_bytes)
        self.settings = settings
        self.calls = S3Calls(settings)
        self._folder = f"{settings.key_prefix}v{VERSION}.{settings.block_bytes}/"

    async def open(self) -> S3Level:
        """Create the client; a server absent at start is a miss on every call until it
        appears, not a failure to start."""
        self.calls.open()
        log.info("object-store level opened", remote=self.name, at=self.settings.where)
        return self

    def ready(self) -> bool:
        return self.calls.store is not None

    async def close(self) -> None:
        await self.finish_writes(self.settings.deadline_s)
        await self.calls.close()

    def path(self, key: BlockKey) -> str:
        """The object name of ``key``'s block."""
        return self._folder + key.hex()

    def _value_bytes(self, key: BlockKey) -> int:
        return HEADER_BYTES + len(key) + self.block_bytes

    # -- block operations ----------------------------------------------------------------

    async def present(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether the bucket holds an object of its size (all False on a fault)."""
        if not keys:
            return []
        self.counters.lookups += 1
        results = await self.calls.batch(_head, [self.path(k) for k in keys])
        if results is None:
            return [False] * len(keys)
        return [
            isinstance(meta, dict) and meta.get("size") == self._value_bytes(key)
            for key, meta in zip(keys, results, strict=True)
        ]

    async def exists(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` the bucket holds (0 on any fault). Asked in windows
        of growing size (4, 16, 64, ... keys, each window's requests sent together), so
        that a prefix the bucket lacks costs a few requests, not one per key, and a long
        run a few round trips."""
        run, window = 0, _FIRST_WINDOW
        while run < len(keys):
            part = keys[run : run + window]
            held = await self.present(part)
            for there in held:
                if not there:
                    return run
                run += 1
            window *= _WINDOW_GROWTH
        return run

    async def get(self, keys: Sequence[BlockKey]) -> list[memoryview]:
        """The verified payloads of the leading ``keys`` the bucket holds intact. Stops at
        the first key missing, unreadable or failing a check; an object that fails a
        check is deleted and counted."""
        if not keys:
            return []
        room = max(self._value_bytes(k) for k in keys)

        async def fetch(store: Any, path: str) -> Any:
            import obstore

            result = await obstore.get_async(store, path)
            size = int(result.meta["size"])
            if size > room:
                return _TooBig(size)
            return await result.bytes_async()

        bodies = await self.calls.batch(fetch, [self.path(k) for k in keys])
        out: list[memoryview] = []
        bad: list[BlockKey] = []
        for key, body in zip(keys, bodies or (), strict=False):
            if body is ABSENT or body is FAILED:
                break
            reason = self._check(key, body)
            if isinstance(reason, str):
                bad.append(key)
                log.warning("object failed a check", remote=self.name, reason=reason)
                break
            out.append(reason)
        self.counters.hits += len(out)
        self.counters.misses += len(keys) - len(out)
        if bad:
            self.counters.corrupt += len(bad)
            await self.calls.batch(_delete, [self.path(k) for k in bad])
            self.event(EventKind.REMOVED, bad)
        return out

    def _check(self, key: BlockKey, body: Any) -> memoryview | str:
        if isinstance(body, _TooBig):
            return f"an object of {body.size} bytes, longer than a block's"
        if body is HELD:
            return "an answer that is not a body"
        self.counters.bytes_read += len(memoryview(body))
        return decode_block(key, body, self.block_bytes)

    async def put(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> int:
        """Write blocks the bucket does not hold yet (create-only); returns how many were
        written."""
        if not keys:
            return 0
        buffers = [self.value_buffer(len(k), len(p)) for k, p in zip(keys, payloads, strict=True)]
        items = []
        for key, payload, buffer in zip(keys, payloads, buffers, strict=True):
            size = encode_into(buffer, key, payload)
            items.append((self.path(key), memoryview(buffer)[:size]))

        async def send(store: Any, item: tuple[str, memoryview]) -> Any:
            import obstore

            return await obstore.put_async(store, item[0], item[1], mode="create")

        results = await self.calls.batch(send, items)
        if results is None:
            self.counters.dropped += len(keys)
            return 0
        return self._written(keys, payloads, buffers, results)

    def _written(
        self,
        keys: Sequence[BlockKey],
        payloads: Sequence[Payload],
        buffers: list[bytearray],
        results: list[Any],
    ) -> int:
        # A buffer whose request was answered was read whole; one cut off may still be
        # read by the client's threads, so it is left alone.
        self.recycle([b for b, r in zip(buffers, results, strict=True) if r is not FAILED])
        written: list[BlockKey] = []
        for key, payload, result in zip(keys, payloads, results, strict=True):
            if result is HELD:
                self.counters.skipped += 1  # by another node, or written meanwhile
            elif result is FAILED:
                self.counters.dropped += 1
            elif result is ABSENT:  # the bucket is gone
                self.counters.write_errors += 1
                self.calls.record_error(f"write refused: no bucket {self.settings.bucket!r}")
            else:
                written.append(key)
                self.counters.bytes_written += HEADER_BYTES + len(key) + len(payload)
        self.counters.stores += len(written)
        if written:
            self.event(EventKind.STORED, written)
        return len(written)

    # -- reporting ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return self.base_stats(self.settings.where)
