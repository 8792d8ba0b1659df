"""How the object-store level calls its S3 server: one request per block, a batch of
them under one deadline, at most ``pool_size`` on the wire, and the circuit breaker.

S3 has no pipelining: a batch of blocks is a batch of requests, sent together
(:meth:`S3Calls.batch`). The whole batch runs under ``deadline_s``; a request still
waiting for a pool slot when it passes is counted ``busy`` (the daemon's own queue), one
on the wire ``timeouts``; either is a miss for that block, never a wait past the
deadline. The breaker is asked once per batch and told once: a batch with any request
that failed to reach the server, timed out or got a server error (5xx, a refusal of the
credentials) counts as one failure; a batch answered in full (``404`` and ``412``
included: those are answers) closes it.

The client is ``obstore`` (Rust's ``object_store``: requests run on its own threads, the
event loop only awaits them). Its retries are off, so that nothing retries behind the
deadline, and its own timeouts are set a little past the deadline to bound a request
this side has stopped waiting for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any, TypeVar

from tierd.remote.notes import CallNotes

__all__ = ["ABSENT", "FAILED", "HELD", "Outcome", "S3Calls", "S3Settings"]

T = TypeVar("T")


class Outcome(Enum):
    """What a request came to when it brought no value."""

    ABSENT = "absent"  # 404: the server holds no such object (or no such bucket)
    HELD = "held"  # 412 on a create-only write: the object exists already
    FAILED = "failed"  # not answered in time, unreachable, or a server error


ABSENT, HELD, FAILED = Outcome.ABSENT, Outcome.HELD, Outcome.FAILED


@dataclass(frozen=True, slots=True)
class S3Settings:
    """What the level needs from :class:`~tierd.config.S3Config` (kept apart so that
    this layer does not import the config layer)."""

    name: str
    block_bytes: int
    bucket: str
    endpoint: str | None = None  # None: the provider's endpoint for ``region``
    region: str = "us-east-1"
    key_prefix: str = "tierd/"
    access_key_id: str | None = None  # None: the usual places (environment, profile)
    secret_access_key: str | None = None
    pool_size: int = 32
    deadline_s: float = 1.0
    max_pending_bytes: int = 64 << 20
    breaker_failures: int = 3
    breaker_backoff_s: float = 0.5
    breaker_max_backoff_s: float = 30.0
    # What the level does on a server that does not keep objects write-once (a create
    # with If-None-Match: * ignored, or refused): "require" refuses to start (or to
    # write, once found out later); "best_effort" runs, saying so (docs/remote.md).
    write_once: str = "require"
    config_path: str = "remote"  # where the level's section sits in the config, for errors

    @property
    def where(self) -> str:
        """Where the level is, for stats, metrics labels and logs (no credentials)."""
        return f"{self.endpoint or 's3:' + self.region}/{self.bucket}"


class S3Calls(CallNotes):
    """The client of one S3 bucket. A fault is an outcome, counted and noted; never an
    exception to the caller."""

    def __init__(self, settings: S3Settings) -> None:
        super().__init__(settings)
        self.settings = settings
        self.store: Any = None
        self._slots = asyncio.Semaphore(settings.pool_size)

    def open(self) -> None:
        """Create the client (it connects on its first request)."""
        from obstore.store import S3Store

        s = self.settings
        late = timedelta(seconds=s.deadline_s * 2 + 1)
        options: Any = {"timeout": late, "connect_timeout": late}
        if s.endpoint is not None and s.endpoint.startswith("http://"):
            options["allow_http"] = True
        config: Any = {"region": s.region}
        if s.endpoint is not None:
            config["endpoint"] = s.endpoint
            config["virtual_hosted_style_request"] = False
        if s.access_key_id is not None:
            config["access_key_id"] = s.access_key_id
            config["secret_access_key"] = s.secret_access_key
        self.store = S3Store(
            s.bucket,
            config=config,
            client_options=options,
            retry_config={"max_retries": 0, "retry_timeout": late},
        )

    async def close(self) -> None:
        self.store = None

    async def batch(
        self,
        request: Callable[[Any, T], Awaitable[Any]],
        items: Sequence[T],
        causes: list[str] | None = None,
    ) -> list[Any] | None:
        """``request(store, item)`` for every item, together, under one deadline and the
        breaker. Each result is the request's value or an :class:`Outcome`; ``None``
        when the breaker refused the batch or the level is closed. ``causes``, when
        given, gets why each request that ``FAILED`` did (``timeouts``, ``busy``,
        ``errors``; ``""`` for the others)."""
        if self.store is None or not items or not self.breaker.allow():
            return None
        store = self.store
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.deadline_s
        if len(items) == 1:  # no task to make and wait for: one request, awaited here
            return self._tally([await self._alone(request, store, items[0], deadline)], causes)
        on_wire = [False] * len(items)
        tasks = [
            loop.create_task(self._one(request, store, item, on_wire, i))
            for i, item in enumerate(items)
        ]
        _, late = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
        for task in late:
            task.cancel()
        if late:
            await asyncio.gather(*late, return_exceptions=True)
        return self._tally(
            [_settled(task, wire) for task, wire in zip(tasks, on_wire, strict=True)], causes
        )

    async def _one(
        self,
        request: Callable[[Any, T], Awaitable[Any]],
        store: Any,
        item: T,
        on_wire: list[bool],
        index: int,
    ) -> Any:
        async with self._slots:
            # Left set when the request ends: a request cancelled at the deadline must
            # still read as on the wire (a timeout, a failure for the breaker), not busy.
            on_wire[index] = True
            return await request(store, item)

    async def _alone(
        self, request: Callable[[Any, T], Awaitable[Any]], store: Any, item: T, deadline: float
    ) -> tuple[_State, Any]:
        wire = False
        try:
            async with asyncio.timeout_at(deadline), self._slots:
                wire = True
                return _State.OK, await request(store, item)
        except TimeoutError:
            return (_State.LATE if wire else _State.BUSY), None
        except Exception as exc:  # what the request raised: judged in _tally
            return _State.RAISED, exc

    def _tally(
        self, settled: list[tuple[_State, Any]], causes: list[str] | None = None
    ) -> list[Any]:
        """Each request's value or outcome; the batch's faults counted, noted and told to
        the breaker once."""
        from obstore.exceptions import AlreadyExistsError, NotFoundError, PreconditionError

        results: list[Any] = []
        why: list[str] = []
        failed = False
        late = 0
        for state, value in settled:
            cause = ""
            if state is _State.OK:
                results.append(value)
            elif state is _State.BUSY:
                self.busy += 1
                cause = "busy"
                results.append(FAILED)
            elif state is _State.LATE:
                self.timeouts += 1
                failed = True
                late += 1
                cause = "timeouts"
                results.append(FAILED)
            elif isinstance(value, NotFoundError | FileNotFoundError):
                results.append(ABSENT)
            elif isinstance(value, AlreadyExistsError | PreconditionError):
                results.append(HELD)
            else:
                self.errors += 1
                failed = True
                cause = "errors"
                self.note(value, "failed")
                results.append(FAILED)
            why.append(cause)
        if causes is not None:
            causes[:] = why
        if late:
            self.note(TimeoutError(f"{late} of {len(settled)} requests"), "timed out")
        if failed:
            self.breaker.failed()
        else:
            self.answered()
        return results


class _State(Enum):
    """How one request of a batch ended."""

    OK = "ok"  # answered with a value
    RAISED = "raised"  # answered with an error (404, 412, 500, ...) or failed to connect
    LATE = "late"  # on the wire at the deadline
    BUSY = "busy"  # still waiting for a pool slot at the deadline


def _settled(task: asyncio.Task[Any], on_wire: bool) -> tuple[_State, Any]:
    if task.cancelled():
        return (_State.LATE if on_wire else _State.BUSY), None
    exc = task.exception()
    return (_State.RAISED, exc) if exc is not None else (_State.OK, task.result())
