"""The work behind the LMCache adapter's tasks: namespaces, locks and object sizes.

:class:`Tasks` maps LMCache's ``ObjectKey`` s to namespaces (one :class:`Space`, that is
one daemon connection, per model and cache salt: :mod:`lmcache_keys`) and block keys,
keeps the table of locked keys (a key locked twice holds two pins; each unlock releases
one), and checks that LMCache's objects are the daemon's block size. It reads LMCache's
objects by duck typing (``chunk_hash``, ``model_name``, ``kv_rank``, ``object_group_id``,
``cache_salt``; a memory object's ``get_size()`` and ``byte_array``), so it imports
nothing of LMCache's.

Every task method runs on one of the adapter's workers and waits at most until its
``expires``; :meth:`Tasks.guarded` turns what the daemon or bad input raises into a
failed task (logged), never into an exception in LMCache's threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from tierd.client import Client, DaemonError, Unreachable, UntrustedDaemon
from tierd.errors import TierdError
from tierd.integrations.core.params import size_advice
from tierd.integrations.lmcache.object_keys import SpaceFacts, block_key, namespace_of
from tierd.integrations.lmcache.space import Pin, Space, SpaceSettings, log

__all__ = ["Tasks"]

T = TypeVar("T")
_std_log = logging.getLogger("tierd.integrations.lmcache")
_PROBE_EVERY_S = 1.0
_PASSING = ("busy", "shutting_down")  # a daemon's answers that do not refuse for good


class _Settings(Protocol):
    @property
    def namespace(self) -> str: ...
    @property
    def block_bytes(self) -> int | None: ...
    @property
    def deadline_s(self) -> float: ...
    @property
    def breaker_failures(self) -> int: ...
    @property
    def reconnect_max_s(self) -> float: ...
    @property
    def server_uids(self) -> tuple[int, ...]: ...
    @property
    def max_namespaces(self) -> int: ...
    @property
    def workers(self) -> int: ...


class Refused(TierdError):
    """The adapter cannot serve this task (wrong object size, too many namespaces,
    a daemon that refuses it, closed)."""


class Tasks:
    """Namespaces, locks and the checks of one adapter."""

    def __init__(self, settings: _Settings, socket_path: str) -> None:
        self.settings = settings
        self.socket_path = socket_path
        self.block_bytes: int | None = None
        self.refusal: str | None = None  # set when the daemon cannot serve LMCache at all
        self._spaces: dict[tuple[str, str], Space] = {}
        self._locks: dict[Any, list[tuple[Space, Pin | None]]] = defaultdict(list)
        self._lock = threading.Lock()
        self._probed = 0.0
        self._warned_sizes: set[int] = set()
        self._closing = False

    # -- start-up: the daemon's block size ------------------------------------------------

    def start(self) -> None:
        """Learn the daemon's block size (a daemon not up yet only warns)."""
        try:
            self._probe(time.monotonic() + self.settings.deadline_s)
        except (TierdError, OSError) as exc:
            log.warning(
                "tierd not reachable at start-up; LMCache's L2 lookups miss until it is",
                socket=self.socket_path,
                error=str(exc),
            )
        if self.refusal is not None:
            log.error("tierd cannot serve this LMCache server", reason=self.refusal)
        else:
            log.info(
                "tierd L2 adapter ready", socket=self.socket_path, block_bytes=self.block_bytes
            )

    def _probe(self, expires: float) -> int:
        if self.block_bytes is not None:
            return self.block_bytes
        if self.refusal is not None:
            raise Refused(self.refusal)
        now = time.monotonic()
        if now - self._probed < _PROBE_EVERY_S:
            raise Unreachable("the daemon was unreachable a moment ago")
        self._probed = now
        wanted = self.settings.block_bytes

        async def hello() -> int:
            async with asyncio.timeout(max(expires - time.monotonic(), 0.001)):
                client = await Client.connect(
                    self.socket_path,
                    map_pool=False,
                    block_bytes=wanted,  # a daemon of several sizes opens it
                    server_uids=self.settings.server_uids,
                )
            await client.close()
            return client.block_bytes

        try:
            # On a thread of its own: LMCache's MP server builds adapters on a running loop.
            with concurrent.futures.ThreadPoolExecutor(1, "tierd-lmcache-hello") as one:
                daemon_bytes = one.submit(lambda: asyncio.run(hello())).result()
        except TimeoutError:
            raise Unreachable(f"no hello from the daemon at {self.socket_path}") from None
        except DaemonError as exc:
            if exc.code in _PASSING:  # starting or stopping: asked again a moment later
                raise Unreachable(f"tierd at {self.socket_path} is {exc.code}") from exc
            self.refusal = f"tierd at {self.socket_path} refused LMCache: {exc}"
            if exc.code == "block_size_mismatch" and wanted is not None:
                self.refusal += f": {size_advice(wanted)}"
            raise Refused(self.refusal) from exc
        except UntrustedDaemon as exc:
            self.refusal = f"tierd at {self.socket_path} refused LMCache: {exc}"
            raise Refused(self.refusal) from exc
        if wanted is not None and wanted != daemon_bytes:
            self.refusal = _size_advice(wanted, daemon_bytes, self.socket_path)
            raise Refused(self.refusal)
        self.block_bytes = daemon_bytes
        return daemon_bytes

    def _check_size(self, size: int, block_bytes: int) -> None:
        if size == block_bytes:
            return
        if size not in self._warned_sizes:
            self._warned_sizes.add(size)
            log.error(
                "LMCache's objects do not fit tierd's blocks: their tasks fail",
                advice=_size_advice(size, block_bytes, self.socket_path),
            )
        raise Refused(f"an object of {size} bytes, blocks of {block_bytes}")

    # -- namespaces -----------------------------------------------------------------------

    def _space(self, key: Any, block_bytes: int) -> Space:
        name = (str(key.model_name), str(key.cache_salt))
        with self._lock:
            space = self._spaces.get(name)
            if space is not None:
                return space
            if self._closing:
                raise Refused("the adapter is closed")
            if len(self._spaces) >= self.settings.max_namespaces:
                raise Refused(
                    f"more than max_namespaces={self.settings.max_namespaces} models and "
                    "cache salts: raise it in adapter_params"
                )
            facts = SpaceFacts(name[0], name[1], block_bytes, self.settings.namespace)
            s = self.settings
            space = Space(
                SpaceSettings(
                    self.socket_path,
                    namespace_of(facts),
                    block_bytes,
                    s.deadline_s,
                    s.breaker_failures,
                    s.reconnect_max_s,
                    s.server_uids,
                    s.workers,
                )
            )
            self._spaces[name] = space
            return space

    def _groups(self, keys: Sequence[Any], expires: float) -> dict[Space, list[int]]:
        """The indices of ``keys`` by namespace (in order)."""
        if self._closing:
            raise Refused("the adapter is closed")
        block_bytes = self._probe(expires)
        groups: dict[Space, list[int]] = defaultdict(list)
        for i, key in enumerate(keys):
            groups[self._space(key, block_bytes)].append(i)
        return groups

    # -- tasks ----------------------------------------------------------------------------

    def store(self, keys: Sequence[Any], objects: Sequence[Any], expires: float) -> int:
        written = 0
        for space, at in self._groups(keys, expires).items():
            for i in at:
                self._check_size(int(objects[i].get_size()), space.settings.block_bytes)
            raw = [_raw(keys[i]) for i in at]
            written += space.store(raw, [objects[i].byte_array for i in at], expires)
        return written

    def lock(self, keys: Sequence[Any], expires: float) -> list[bool]:
        found = [False] * len(keys)
        for space, at in self._groups(keys, expires).items():
            present, pins = space.lock([_raw(keys[i]) for i in at], expires)
            with self._lock:
                for i, here, pin in zip(at, present, pins, strict=True):
                    if here:
                        self._locks[keys[i]].append((space, pin))
                        found[i] = True
        return found

    def unlock(self, keys: Sequence[Any]) -> None:
        """Release one pin per key (never blocks; a key not locked is ignored)."""
        by_space: dict[Space, list[Pin]] = defaultdict(list)
        with self._lock:
            for key in keys:
                held = self._locks.get(key)
                if not held:
                    continue
                space, pin = held.pop(0)
                if not held:
                    del self._locks[key]
                if pin is not None:
                    by_space[space].append(pin)
        for space, pins in by_space.items():
            space.unpin(pins)

    def load(self, keys: Sequence[Any], objects: Sequence[Any], expires: float) -> list[bool]:
        done = [False] * len(keys)
        for space, at in self._groups(keys, expires).items():
            wanted = [i for i in at if _fits(objects[i], space.settings.block_bytes)]
            with self._lock:  # each pin taken is held: an unlock meanwhile keeps its slot
                pins = [self._pin_of(keys[i], space) for i in wanted]
                held = [pin for pin in pins if pin is not None]
                space.hold(held)
            try:
                raw = [_raw(keys[i]) for i in wanted]
                targets = [objects[i].byte_array for i in wanted]
                for i, ok in zip(wanted, space.load(raw, targets, pins, expires), strict=True):
                    done[i] = ok
            finally:
                space.unpin(held)
        return done

    def _pin_of(self, key: Any, space: Space) -> Pin | None:
        for owner, pin in self._locks.get(key, ()):
            if owner is space and pin is not None:
                return pin
        return None

    def touch(self, keys: Sequence[Any]) -> None:
        if self.block_bytes is None:
            return
        for space, at in self._groups(keys, time.monotonic() + 1).items():
            space.touch([_raw(keys[i]) for i in at])

    def delete(self, keys: Sequence[Any]) -> None:
        if self.block_bytes is None:
            return
        for space, at in self._groups(keys, time.monotonic() + 1).items():
            space.delete([_raw(keys[i]) for i in at])

    # -- reports and shutdown ---------------------------------------------------------------

    def usage(self) -> dict[str, int]:
        with self._lock:
            spaces = list(self._spaces.items())
        by_salt: dict[str, int] = defaultdict(int)
        for (_, salt), space in spaces:
            space.refresh_usage()
            by_salt[salt] += space.used_bytes
        return dict(by_salt)

    def status(self) -> dict[str, Any]:
        with self._lock:
            spaces = list(self._spaces.values())
            locked = sum(len(pins) for pins in self._locks.values())
        return {
            "is_healthy": self.refusal is None
            and self.block_bytes is not None  # the daemon answered once at least
            and all(s.link.connected and not s.link.breaker.is_open for s in spaces),
            "type": "tierd",
            "socket": self.socket_path,
            "block_bytes": self.block_bytes,
            "refusal": self.refusal,
            "locked_keys": locked,
            "namespaces": {
                s.settings.namespace: {
                    "connected": s.link.connected,
                    "breaker_open": s.link.breaker.is_open,
                    "bytes": s.used_bytes,
                }
                for s in spaces
            },
        }

    def guarded(self, call: Callable[[], T]) -> T | None:
        """``call()``, or None when it failed (logged; the task fails)."""
        try:
            return call()
        except (TierdError, OSError, ValueError) as exc:
            log.debug("tierd L2 task failed", error=f"{type(exc).__name__}: {exc}")
        except Exception:  # a task must finish whatever happened; said loudly
            _std_log.exception("tierd L2 task failed unexpectedly")
        return None

    def closing(self) -> None:
        self._closing = True

    def close(self) -> None:
        """Close every connection: the daemon releases their pins with them."""
        with self._lock:
            spaces, self._spaces = list(self._spaces.values()), {}
            self._locks.clear()
        for space in spaces:
            space.close()


def _raw(key: Any) -> bytes:
    return block_key(bytes(key.chunk_hash), int(key.kv_rank), int(key.object_group_id))


def _fits(obj: Any, block_bytes: int) -> bool:
    return int(obj.get_size()) == block_bytes


def _size_advice(lmcache_bytes: int, daemon_bytes: int, socket_path: str) -> str:
    return (
        f"the tierd daemon at {socket_path} stores blocks of {daemon_bytes} bytes, but "
        f"LMCache's objects (one chunk of KV, after serde) are {lmcache_bytes} bytes: set "
        f"`block_bytes: {lmcache_bytes}` in tierd's config and restart it (or, with"
        f" `block_sizes: 2` or more, name `block_bytes: {lmcache_bytes}` in the adapter's"
        " parameters so that the daemon serves that size too)"
    )
