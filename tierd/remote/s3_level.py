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
- ``write``: a ``PUT`` per block with ``If-None-Match: *``: a block is stored once however
  many nodes send it (the server answers ``412`` to the others, counted ``skipped``).

Write-once is the server's to keep, so the level checks it at start (:meth:`S3Level.
check_write_once`): it creates a probe object under ``key_prefix`` twice, both with
``If-None-Match: *``, and deletes it. The second create must be refused (``412``). A
server that accepts it (it ignores the condition, and overwrites) or that refuses
conditional writes (``501 NotImplemented``) does not keep objects write-once: with
``write_once: require`` (the default) the level refuses to start, naming what the server
did; with ``best_effort`` it runs and says so (log, stats, ``tierd health``), writing
plain PUTs where the condition is refused. A server that does not answer the check
at start is checked again before the first write (at most once per breaker back-off);
until it has answered, ``require`` holds writes back.

The server keeps the objects; tierd keeps no index of them and never evicts them: the
bucket's lifecycle rules do (docs/remote.md). Faults are misses, never stalls and never
errors to the caller (:class:`~tierd.remote.s3_calls.S3Calls`).
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import Sequence
from enum import StrEnum
from typing import Any, Literal

from tierd.errors import ConfigError
from tierd.events import EventKind
from tierd.keys import BlockKey, Medium
from tierd.logs import get_logger
from tierd.remote.level import Landing, LevelBase, Payload
from tierd.remote.s3_calls import ABSENT, FAILED, HELD, S3Calls, S3Settings
from tierd.remote.values import HEADER_BYTES, VERSION, decode_block, encode_into

__all__ = ["S3Level", "WriteOnce"]

log = get_logger("tierd.remote")

_FIRST_WINDOW = 4  # keys asked in the first round of an existence check
_WINDOW_GROWTH = 4  # each further round asks this many times more


class WriteOnce(StrEnum):
    """What the level found its server does with a create-only write (``If-None-Match: *``)."""

    HONOURED = "honoured"  # a second create of one object is refused (412): write-once
    UNCHECKED = "unchecked"  # the server has not answered the check yet
    IGNORED = "ignored"  # a second create succeeds: the server overwrites
    REJECTED = "rejected"  # the server refuses conditional writes (501 NotImplemented, ...)


_PROBE_BODY = b"tierd write-once probe: safe to delete\n"
# An error answer that says the server does not do conditional writes at all.
_NOT_IMPLEMENTED = re.compile(r"\b501\b|NotImplemented|not implemented", re.IGNORECASE)


class _Created:
    """A probe create the server accepted."""


class _Refused:
    """A probe create the server refused as a request it does not implement."""

    def __init__(self, text: str) -> None:
        self.text = text


_STATUS = re.compile(r"status code: (\d{3}[A-Za-z ]*)")
_CODE = re.compile(r"<Code>([^<]{1,64})</Code>")


def _refusal(exc: BaseException) -> str:
    """What the server answered, in a few words: ``501 Not Implemented (NotImplemented)``."""
    text = str(exc)
    status, code = _STATUS.search(text), _CODE.search(text)
    if status is None:
        return text.strip().split("\n", 1)[0][:300]
    return status.group(1).strip() + (f" ({code.group(1)})" if code else "")


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
        self.write_once = WriteOnce.UNCHECKED
        self.write_once_why = "not checked yet"
        self._checking = asyncio.Lock()
        self._next_check = 0.0  # monotonic time before which no new check is made

    async def open(self) -> S3Level:
        """Create the client and check that the server keeps objects write-once. A server
        absent at start is a miss on every call until it appears, not a failure to start;
        one that does not keep objects write-once is a :class:`ConfigError` under
        ``write_once: require`` (the default)."""
        self.calls.open()
        state = await self.check_write_once()
        where, mode = self.settings.where, self.settings.write_once
        if state in (WriteOnce.IGNORED, WriteOnce.REJECTED) and mode != "best_effort":
            await self.calls.close()
            path = f"{self.settings.config_path}.write_once"
            raise ConfigError(
                f"the S3 server at {where} {self.write_once_why}, so it does not keep"
                " objects write-once: a node could overwrite another's block. Use a server"
                " that answers 412 to a second create (If-None-Match: *), or set"
                f" {path}: best_effort to run without that guarantee",
                path=path,
            )
        log.info("object-store level opened", remote=self.name, at=where, write_once=str(state))
        if state is WriteOnce.UNCHECKED:
            log.warning(
                "write-once not checked: the server did not answer",
                remote=self.name,
                at=where,
                why=self.write_once_why,
                consequence="checked again before the first write"
                + ("; until then writes are held back" if mode != "best_effort" else ""),
            )
        elif state is not WriteOnce.HONOURED:
            log.warning(
                "object-store level runs without write-once (write_once: best_effort)",
                remote=self.name,
                at=where,
                server=self.write_once_why,
                consequence="an object two nodes write is overwritten, the last one wins",
            )
        return self

    async def check_write_once(self) -> WriteOnce:
        """Whether the server refuses a second create of an object: a probe object (a
        fresh name under ``key_prefix``) is created twice with ``If-None-Match: *``, then
        deleted. Checked once; a check the server did not answer is made again on the
        next call at least a breaker back-off later."""
        async with self._checking:
            if self.write_once is not WriteOnce.UNCHECKED or time.monotonic() < self._next_check:
                return self.write_once
            path = f"{self.settings.key_prefix}write-once-probe-{secrets.token_hex(8)}"
            first = await self._probe_create(path)
            second = await self._probe_create(path) if isinstance(first, _Created) else None
            if isinstance(first, _Created) or isinstance(second, _Created):
                await self.calls.batch(_delete, [path])
            state, why = _judged(first, second)
            if state is WriteOnce.UNCHECKED and why == "no answer" and self.calls.last_error:
                why = f"no answer: {self.calls.last_error}"
            self.write_once, self.write_once_why = state, why
            if state is WriteOnce.UNCHECKED:
                self._next_check = time.monotonic() + self.settings.breaker_backoff_s
            return state

    async def _probe_create(self, path: str) -> Any:
        """One create-only write of the probe object: :class:`_Created`, :class:`_Refused`
        or an outcome (``HELD``: 412; ``ABSENT``, ``FAILED``, ``None``: no answer)."""

        async def create(store: Any, name: str) -> Any:
            import obstore
            from obstore.exceptions import AlreadyExistsError, PreconditionError

            try:
                await obstore.put_async(store, name, _PROBE_BODY, mode="create")
            except (AlreadyExistsError, PreconditionError, FileNotFoundError):
                raise
            except Exception as exc:
                if _NOT_IMPLEMENTED.search(str(exc)):
                    return _Refused("answered " + _refusal(exc))
                raise
            return _Created()

        results = await self.calls.batch(create, [path])
        return None if results is None else results[0]

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

    async def write(self, keys: Sequence[BlockKey], payloads: Sequence[Payload]) -> Landing:
        """Write blocks the bucket does not hold yet (create-only, where the server keeps
        that); what became of each."""
        count = len(keys)
        if not keys:
            return Landing()
        if not self.write_allowed(count):
            return Landing.of(self.name, count, 0, {"refused": count})
        mode = await self._write_mode()
        if mode is None:  # write_once: require, and the server does not (or has not said)
            self.counters.dropped += count
            return self.write_done(Landing.of(self.name, count, 0, {"unchecked": count}))
        buffers = [self.value_buffer(len(k), len(p)) for k, p in zip(keys, payloads, strict=True)]
        items = []
        for key, payload, buffer in zip(keys, payloads, buffers, strict=True):
            size = encode_into(buffer, key, payload)
            items.append((self.path(key), memoryview(buffer)[:size]))

        async def send(store: Any, item: tuple[str, memoryview]) -> Any:
            import obstore

            return await obstore.put_async(store, item[0], item[1], mode=mode)

        causes: list[str] = []
        results = await self.calls.batch(send, items, causes)
        if results is None:
            self.counters.dropped += count
            return self.write_done(Landing.of(self.name, count, 0, {"refused": count}))
        return self.write_done(self._written(keys, payloads, buffers, results, causes))

    async def _write_mode(self) -> Literal["create", "overwrite"] | None:
        """How blocks are written now: ``"create"`` (``If-None-Match: *``), ``"overwrite"``
        (a plain PUT: best effort on a server that refuses the condition) or ``None``
        (not at all: ``write_once: require`` and the server does not keep it, or has not
        answered the check yet)."""
        state = self.write_once
        if state is WriteOnce.UNCHECKED:
            state = await self.check_write_once()
        if state is WriteOnce.HONOURED:
            return "create"
        if self.settings.write_once != "best_effort":
            return None
        return "overwrite" if state is WriteOnce.REJECTED else "create"

    def _written(
        self,
        keys: Sequence[BlockKey],
        payloads: Sequence[Payload],
        buffers: list[bytearray],
        results: list[Any],
        causes: list[str],
    ) -> Landing:
        # A buffer whose request was answered was read whole; one cut off may still be
        # read by the client's threads, so it is left alone.
        self.recycle([b for b, r in zip(buffers, results, strict=True) if r is not FAILED])
        written: list[BlockKey] = []
        missed: dict[str, int] = {}
        for key, payload, result, cause in zip(keys, payloads, results, causes, strict=True):
            if result is HELD:
                self.counters.skipped += 1  # by another node, or written meanwhile
            elif result is FAILED:
                self.counters.dropped += 1
                missed[cause] = missed.get(cause, 0) + 1
            elif result is ABSENT:  # the bucket is gone
                self.counters.write_errors += 1
                missed["write_errors"] = missed.get("write_errors", 0) + 1
                self.calls.record_error(f"write refused: no bucket {self.settings.bucket!r}")
            else:
                written.append(key)
                self.counters.bytes_written += HEADER_BYTES + len(key) + len(payload)
        self.counters.stores += len(written)
        if written:
            self.event(EventKind.STORED, written)
        return Landing.of(self.name, len(keys), len(written), missed)

    # -- reporting ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            **self.base_stats(self.settings.where),
            "write_once": str(self.write_once),
            "write_once_mode": self.settings.write_once,
        }

    def problems(self) -> list[str]:
        out = super().problems()
        if self.settings.write_once == "best_effort" or self.write_once is WriteOnce.HONOURED:
            return out
        if self.write_once is WriteOnce.UNCHECKED:
            out.append(
                "write-once not checked yet (the server has not answered the check:"
                f" {self.write_once_why}): blocks are held back until it has"
            )
        else:
            out.append(
                f"the server {self.write_once_why}: it does not keep objects write-once,"
                " so no block is written (write_once: require)"
            )
        return out

    def health(self) -> list[dict[str, Any]]:
        [line] = super().health()
        if self.settings.write_once == "best_effort" and self.write_once is not WriteOnce.HONOURED:
            line["notes"] = [
                f"write_once best_effort: write-once {self.write_once} ({self.write_once_why})"
            ]
        return [line]


def _judged(first: Any, second: Any) -> tuple[WriteOnce, str]:
    """What the two probe creates say of the server, and why, in words."""
    if isinstance(first, _Refused) or isinstance(second, _Refused):
        refused = first if isinstance(first, _Refused) else second
        return WriteOnce.REJECTED, f"refuses conditional writes (If-None-Match: *): {refused.text}"
    if first is HELD:
        return WriteOnce.REJECTED, "answered 412 to the create of an object that did not exist"
    if isinstance(first, _Created) and second is HELD:
        return WriteOnce.HONOURED, "refuses a second create (412)"
    if isinstance(first, _Created) and isinstance(second, _Created):
        return WriteOnce.IGNORED, "ignores If-None-Match: * (a second create overwrote the object)"
    answer = first if not isinstance(first, _Created) else second
    if answer is ABSENT:
        return WriteOnce.UNCHECKED, "no such bucket"
    return WriteOnce.UNCHECKED, "no answer"
