"""One client connection's view of the chain: its namespace, its leases, its requests.

A :class:`Session` turns decoded requests into chain calls and replies; it owns no
socket (the connection hands it messages and a ``send`` callback), so every rule of the
protocol can be exercised without one.

- **Tenants.** The connection's :class:`~tierd.control.tenants.Grant` (decided by the
  server from the peer's kernel credentials, never from what the client says) names its
  tenant: every data operation goes to that tenant's chain and no other. Operator
  operations (``clear``, ``flush``, ``stop``, ``config``, ``metrics``) need an operator
  grant; others get ``not_allowed``.
- **Namespaces.** ``hello`` names the client's namespace, which must be one of its
  tenant's patterns; every key the client sends is prefixed with the namespace's 8-byte
  id before it reaches the chain, and stripped from the events it receives, so blocks of
  different namespaces never collide.
- **Pool.** A ``hello`` with ``pool_fd: true`` gets the tenant's pool descriptor passed
  with its reply (SCM_RIGHTS, by the connection); no pool has a path to open.
- **Leases.** ``prepare_store`` and ``prepare_load`` hand out a lease id naming the
  reserved or pinned blocks; only this session can finish it. The blocks a connection,
  and its tenant, hold in open leases are bounded; a store lease not finished within
  ``store_lease_ttl_s`` is aborted; a load waits at most ``load_wait_s`` on blocks
  another client is still writing. :meth:`close` aborts and releases every lease left,
  and a request still running when the session closes gives its lease back as soon as
  it ends. A client that dies therefore never leaks a pin or a slot.
- **Errors.** A bad request gets an error reply and changes nothing; an unexpected
  exception is logged with its traceback and answered ``internal``.
- **Timing.** Every answered request of a known operation is timed from its arrival to
  its reply into ``ctx.timing`` (latency histograms, per-request debug lines).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog

from tierd.chain import FlushResult, LoadHandle, LookupResult, StoreHandle, TierChain
from tierd.control.context import ServerContext
from tierd.control.event_stream import EventStream
from tierd.control.protocol import (
    PASS_FDS,
    PROTOCOL_VERSION,
    ErrorCode,
    bool_list_field,
    bytes_list_field,
    error_reply,
    int_field,
    keys_field,
    opt_str_field,
)
from tierd.control.tenants import Grant, Tenant
from tierd.errors import (
    BlockMissing,
    CapacityError,
    ProtocolError,
    ResourceClosed,
    StoreIOError,
    TierdError,
    TransferError,
)
from tierd.keys import MAX_KEY_BYTES, BlockKey

__all__ = ["Session"]

log = structlog.get_logger("tierd.control")

Reply = dict[str, Any]
Lease = StoreHandle | LoadHandle
# Refused while the daemon drains; finishing a lease (complete_store) is still allowed.
_MAX_ID = (1 << 64) - 1
_STARTS_WORK = frozenset({"prepare_store", "prepare_load", "put", "get", "flush"})
_H = TypeVar("_H", StoreHandle, LoadHandle)
_EXPIRED_MEMORY = 1024  # lease ids remembered as expired, for a clear error
# A load's reply carries the slowest medium it read from under this key, for the timing;
# it is taken out before the reply is sent.
_LOADED_FROM = "_loaded_from"


class Session:
    """Requests from one client; ``send`` writes a message back to it."""

    def __init__(
        self,
        ctx: ServerContext,
        send: Callable[[dict[str, Any]], None],
        conn: int = 0,
        grant: Grant | None = None,
    ) -> None:
        self.ctx = ctx
        self.send = send
        self.conn = conn  # the connection's id, in debug lines
        self.grant = Grant(None, False)  # no rights until admitted
        self.tenant: Tenant | None = None
        self.greeted = False
        self.namespace: str | None = None
        self.prefix = b""
        self.leases: dict[int, Lease] = {}
        self.held = 0  # blocks this connection holds in open leases
        self._held_by_lease: dict[int, int] = {}
        self._expiry: dict[int, asyncio.TimerHandle] = {}
        self._expired: dict[int, None] = {}  # recently expired lease ids, oldest first
        self.tasks: set[asyncio.Task[None]] = set()
        self.spawned: asyncio.Task[None] | None = None  # the task of the last request handled
        self.closed = False
        self._stream: EventStream | None = None
        self.writable = asyncio.Event()  # cleared while the client's socket is full
        self.writable.set()
        self._sync: dict[str, Callable[[dict[str, Any]], Reply]] = {
            "hello": self._hello,
            "lookup": self._lookup,
            "touch": self._touch,
            "complete_load": self._complete_load,
            "abort_store": self._abort_store,
            "subscribe": self._subscribe,
            "unsubscribe": self._unsubscribe,
            "clear": self._clear,
            "stop": self._stop,
            "stats": lambda msg: {"stats": ctx.stats(self.grant)},
            "health": lambda msg: ctx.health(),
            "config": self._config,
            "metrics": self._metrics,
        }
        self._async: dict[str, Callable[[dict[str, Any]], Awaitable[Reply]]] = {
            "prepare_store": self._prepare_store,
            "complete_store": self._complete_store,
            "prepare_load": self._prepare_load,
            "put": self._put,
            "get": self._get,
            "flush": self._flush,
        }
        if grant is not None:
            self.admit(grant)

    def admit(self, grant: Grant) -> None:
        """The peer is ``grant``'s (decided by the server from its credentials)."""
        self.grant = grant
        self.tenant = grant.tenant
        if self.tenant is not None and self.tenant.chain.remote is not None:
            self._sync.pop("lookup", None)  # a lookup asks the remote level too
            self._async["lookup"] = self._find

    # -- dispatch ---------------------------------------------------------------------

    def handle(self, msg: Any) -> None:
        """Answer one decoded message (a :class:`ProtocolError` for an undecodable one)."""
        self.ctx.requests += 1
        started = time.perf_counter_ns()
        if type(msg) is dict and self.greeted:
            # The hot path: a well-formed synchronous request (lookup, touch, ...).
            request_id, op = msg.get("id"), msg.get("op")
            if type(request_id) is int and type(op) is str and 0 <= request_id <= _MAX_ID:
                sync = self._sync.get(op)
                if sync is not None:
                    try:
                        fields = sync(msg)
                    except Exception as exc:  # cancellation propagates
                        result = self._fail(request_id, exc)
                    else:
                        self._reply(request_id, fields)
                        result = "ok"
                    self.ctx.timing.observe(self.conn, op, msg, started, result)
                    return
        self._dispatch(msg, started)

    def _dispatch(self, msg: Any, started: int) -> None:
        """Every other message: check it field by field, then answer or start it."""
        request_id = msg.get("id", 0) if isinstance(msg, dict) else 0
        if not isinstance(request_id, int) or isinstance(request_id, bool) or request_id < 0:
            request_id = 0
        known: str | None = None  # the op, once it names an operation: then it is timed
        try:
            if isinstance(msg, ProtocolError):
                raise msg
            if not isinstance(msg, dict):
                raise ProtocolError("a request must be a map", code=ErrorCode.BAD_REQUEST)
            int_field(msg, "id")
            op = msg.get("op")
            if not isinstance(op, str):
                raise ProtocolError("field 'op' must be a string", code=ErrorCode.BAD_REQUEST)
            if op in self._sync or op in self._async:
                known = op
            if not self.greeted and op != "hello":
                raise ProtocolError(
                    "the first request must be hello", code=ErrorCode.HELLO_REQUIRED
                )
            if self.ctx.shutting_down and op in _STARTS_WORK:
                raise ProtocolError("the daemon is shutting down", code=ErrorCode.SHUTTING_DOWN)
            sync = self._sync.get(op)
            if sync is not None:
                self._reply(request_id, sync(msg))
            elif op in self._async:
                self._spawn(request_id, self._async[op](msg), op, msg, started)
                return  # timed when it replies
            else:
                raise ProtocolError(f"unknown op {op[:64]!r}", code=ErrorCode.UNKNOWN_OP)
        except Exception as exc:  # every failure becomes a reply; cancellation propagates
            result = self._fail(request_id, exc)
        else:
            result = "ok"
        if known is not None:
            self.ctx.timing.observe(self.conn, known, msg, started, result)

    def _spawn(
        self, request_id: int, work: Awaitable[Reply], op: str, msg: Reply, started: int
    ) -> None:
        async def run() -> None:
            medium = None
            try:
                reply = await work
            except Exception as exc:
                result = self._fail(request_id, exc)
            else:
                medium = reply.pop(_LOADED_FROM, None)
                self._reply(request_id, reply)
                result = "ok"
            self.ctx.timing.observe(self.conn, op, msg, started, result, medium)

        task = asyncio.get_running_loop().create_task(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        self.spawned = task

    def _reply(self, request_id: int, fields: Reply) -> None:
        if not self.closed:
            self.send({"id": request_id, "ok": True, **fields})

    def _fail(self, request_id: int, exc: Exception) -> str:
        """Answer ``exc`` as an error reply; returns its code."""
        code = _error_code(exc)
        if code is ErrorCode.INTERNAL:
            log.error("request failed", namespace=self.namespace, exc_info=exc)
        self.ctx.count_error(code)
        if not self.closed:
            self.send(error_reply(request_id, code, str(exc) or type(exc).__name__))
        return str(code)

    # -- handshake and queries --------------------------------------------------------

    def _hello(self, msg: dict[str, Any]) -> Reply:
        if self.greeted:
            raise ProtocolError("hello was already done", code=ErrorCode.BAD_REQUEST)
        version = int_field(msg, "version")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {version} is not supported (this daemon speaks"
                f" {PROTOCOL_VERSION})",
                code=ErrorCode.VERSION_MISMATCH,
            )
        block_bytes = msg.get("block_bytes")
        if block_bytes is not None and int_field(msg, "block_bytes") != self.ctx.block_bytes:
            raise ProtocolError(
                f"block size {block_bytes} does not match the daemon's {self.ctx.block_bytes}",
                code=ErrorCode.BLOCK_SIZE_MISMATCH,
            )
        namespace = opt_str_field(msg, "namespace", max_len=1024)
        if namespace is not None:
            if self.tenant is None:
                raise ProtocolError(
                    "this user belongs to no tenant: it may run operator commands, without"
                    " a namespace, and keeps no blocks",
                    code=ErrorCode.NOT_ALLOWED,
                )
            problem = self.ctx.check_namespace(namespace) or self.tenant.namespace_problem(
                namespace
            )
            if problem is not None:
                raise ProtocolError(problem, code=ErrorCode.BAD_NAMESPACE)
            self.prefix = self.ctx.namespace_id(namespace)
            self.namespace = namespace
        self.greeted = True
        reply = self.ctx.hello_fields(self.prefix, self.tenant)
        pool = self.tenant.pool if self.tenant is not None else None
        if msg.get("pool_fd") is True and pool is not None:
            reply[PASS_FDS] = [pool.fd]  # the connection sends it beside this reply
        return reply

    def _chain(self) -> TierChain:
        """The chain of this connection's tenant."""
        if self.tenant is None:
            raise ProtocolError(
                "this user belongs to no tenant: it keeps no blocks",
                code=ErrorCode.NOT_ALLOWED,
            )
        return self.tenant.chain

    def _require_operator(self, op: str, *, without_namespace: bool = False) -> None:
        if not self.grant.operator:
            raise ProtocolError(
                f"{op} needs an operator: tenant {self.grant.label} may not send it",
                code=ErrorCode.NOT_ALLOWED,
            )
        if without_namespace and self.namespace is not None:
            raise ProtocolError(
                f"{op} acts for every client: only a connection without a namespace (an"
                " operator's) may send it",
                code=ErrorCode.NOT_ALLOWED,
            )

    def _config(self, msg: dict[str, Any]) -> Reply:
        self._require_operator("config")
        return {"config": self.ctx.config}

    def _metrics(self, msg: dict[str, Any]) -> Reply:
        self._require_operator("metrics")
        return {"text": self.ctx.metrics()}

    def _keys(self, msg: dict[str, Any], name: str = "keys") -> list[BlockKey]:
        if self.namespace is None:
            self._chain()  # a user of no tenant is told that first
            raise ProtocolError(
                "data operations need a namespace: name one in hello",
                code=ErrorCode.NAMESPACE_REQUIRED,
            )
        keys = msg.get(name)
        if type(keys) is list and 0 < len(keys) <= self.ctx.max_keys:
            # The hot path, at C speed: prefixing fails for anything but bin, then lengths.
            try:
                out: list[BlockKey] = list(map(self.prefix.__add__, keys))  # type: ignore[arg-type]
            except TypeError:
                pass
            else:
                if min(map(len, keys)) > 0 and max(map(len, out)) <= MAX_KEY_BYTES:
                    return out
        # Something is wrong: let the field check name it.
        keys_field(msg, name=name, max_keys=self.ctx.max_keys, max_key_bytes=self.ctx.max_key_bytes)
        raise ProtocolError(f"field {name!r} is not a list of keys", code=ErrorCode.BAD_KEY)

    def _lookup(self, msg: dict[str, Any]) -> Reply:
        return self._lookup_reply(self._chain().lookup(self._keys(msg)))

    async def _find(self, msg: dict[str, Any]) -> Reply:
        return self._lookup_reply(await self._chain().find(self._keys(msg)))

    @staticmethod
    def _lookup_reply(result: LookupResult) -> Reply:
        return {
            "count": result.count,
            "media": list(result.media),  # StrEnum values pack as msgpack str
            "in_flight": result.in_flight,
        }

    def _touch(self, msg: dict[str, Any]) -> Reply:
        self._chain().touch(self._keys(msg))
        return {}

    def _tenants_asked(self, msg: dict[str, Any]) -> list[Tenant]:
        """Every tenant, or the one the ``tenant`` field names."""
        name = opt_str_field(msg, "tenant")
        if name is None:
            return list(self.ctx.tenants.tenants)
        tenant = self.ctx.tenants.named(name)
        if tenant is None:
            names = ", ".join(t.name for t in self.ctx.tenants.tenants)
            raise ProtocolError(f"no tenant named {name!r} ({names})", code=ErrorCode.BAD_REQUEST)
        return [tenant]

    def _clear(self, msg: dict[str, Any]) -> Reply:
        self._require_operator("clear", without_namespace=True)
        tenants = self._tenants_asked(msg)
        name = opt_str_field(msg, "tier")
        names = [level.tier.name for level in tenants[0].chain.levels]
        if name is not None and name not in names:
            raise ProtocolError(
                f"no tier named {name!r} (tiers: {', '.join(names)})",
                code=ErrorCode.UNKNOWN_TIER,
            )
        index = None if name is None else names.index(name)
        return {"removed": sum(tenant.chain.clear(index) for tenant in tenants)}

    def _stop(self, msg: dict[str, Any]) -> Reply:
        self._require_operator("stop", without_namespace=True)
        if self.ctx.request_stop is None:
            raise ProtocolError("this server cannot be stopped", code=ErrorCode.NOT_ALLOWED)
        self.ctx.request_stop()  # the daemon drains on a later turn: this reply goes first
        return {"pid": os.getpid()}

    async def _flush(self, msg: dict[str, Any]) -> Reply:
        self._require_operator("flush")
        done = FlushResult(0)
        for tenant in self._tenants_asked(msg):
            done = done.plus(await tenant.chain.flush())
        return {
            "copied": done.copied,
            "dirty": done.left_dirty,
            "dirty_by_tier": done.dirty,
            "reason": done.reason,
        }

    # -- zero-copy data path ----------------------------------------------------------

    def _require_pool(self) -> None:
        if self.tenant is not None and self.tenant.pool is None:
            raise ProtocolError(
                "the entry tier is not a shared-memory pool: use put and get",
                code=ErrorCode.NO_POOL,
            )

    async def _prepare_store(self, msg: dict[str, Any]) -> Reply:
        keys = _distinct(self._keys(msg))
        chain = self._chain()
        self._require_pool()
        taken = self._take(len(keys))
        try:
            handle = await chain.begin_store(keys)
        except BaseException:
            self._give(taken)
            raise
        self._give(taken - len(handle.keys))
        slot_of = dict(zip(handle.keys, handle.slots, strict=True))
        slots = [slot_of.get(key) for key in keys]
        if not handle.keys:
            await handle.commit()
            return {"lease": None, "slots": slots}
        return {"lease": self._lease(handle), "slots": slots}

    async def _complete_store(self, msg: dict[str, Any]) -> Reply:
        lease, handle = self._lease_of(msg, StoreHandle)
        ok = bool_list_field(msg, "ok", count=len(handle.keys))
        self._end(lease)
        return {"stored": len(await handle.commit(ok))}

    def _abort_store(self, msg: dict[str, Any]) -> Reply:
        lease, handle = self._lease_of(msg, StoreHandle)
        self._end(lease)
        handle.abort()
        return {}

    async def _prepare_load(self, msg: dict[str, Any]) -> Reply:
        keys = self._keys(msg)
        chain = self._chain()
        self._require_pool()
        taken = self._take(len(dict.fromkeys(keys)))
        try:
            handle = await chain.load(keys, wait_s=self.ctx.limits.load_wait_s)
        except BlockMissing:
            self._give(taken)
            return {"lease": None, "count": 0, "slots": []}
        except BaseException:
            self._give(taken)
            raise
        self._give(taken - len(handle.keys))
        return {
            "lease": self._lease(handle),
            "count": len(handle.keys),
            "slots": handle.slots,
            _LOADED_FROM: str(handle.source_medium),
        }

    def _complete_load(self, msg: dict[str, Any]) -> Reply:
        lease, handle = self._lease_of(msg, LoadHandle)
        self._end(lease)
        handle.release()
        return {}

    # -- inline data path -------------------------------------------------------------

    async def _put(self, msg: dict[str, Any]) -> Reply:
        keys = _distinct(self._keys(msg))
        data = bytes_list_field(msg, "data", count=len(keys), size=self.ctx.block_bytes)
        return {"stored": len(await self._chain().store(keys, data))}

    async def _get(self, msg: dict[str, Any]) -> Reply:
        keys = self._keys(msg)
        chain = self._chain()
        room = (self.ctx.limits.max_frame_bytes - 4096) // (self.ctx.block_bytes + 16)
        if len(keys) > room:
            raise ProtocolError(
                f"a get of {len(keys)} blocks would not fit in one frame: at most {room}",
                code=ErrorCode.TOO_MANY_KEYS,
            )
        try:
            handle = await chain.load(keys, wait_s=self.ctx.limits.load_wait_s)
        except BlockMissing:
            return {"count": 0, "data": []}
        try:
            if handle.store.has_views:
                data = [bytes(memoryview(v).cast("B")) for v in handle.views()]
            else:
                out = [bytearray(self.ctx.block_bytes) for _ in handle.keys]
                ok = await handle.read_into(out)
                data = [bytes(b) for b in out[: _leading(ok)]]
        finally:
            handle.release()
        return {"count": len(data), "data": data, _LOADED_FROM: str(handle.source_medium)}

    # -- leases -----------------------------------------------------------------------

    def _take(self, blocks: int) -> int:
        """Count ``blocks`` as held by this connection before asking the chain for them
        (so pipelined requests cannot all pass the bounds); refused past a bound."""
        tenant = self.tenant
        if tenant is None:
            return 0
        problem = tenant.lease_problem(self.held, blocks)
        if problem is not None:
            tenant.lease_refusals += 1
            raise ProtocolError(problem, code=ErrorCode.CAPACITY)
        self.held += blocks
        tenant.held += blocks
        return blocks

    def _give(self, blocks: int) -> None:
        if blocks and self.tenant is not None:
            self.held -= blocks
            self.tenant.held -= blocks

    def _lease(self, handle: Lease) -> int:
        """Register ``handle`` as this session's; if the session closed meanwhile (the
        request outlived its client), give the blocks back at once. A store lease is
        aborted if it is not finished within ``store_lease_ttl_s``."""
        if self.closed:
            self._give(len(handle.keys))
            _finish(handle)
            raise ProtocolError("the connection closed", code=ErrorCode.SHUTTING_DOWN)
        lease = self.ctx.new_lease_id()
        self.leases[lease] = handle
        self._held_by_lease[lease] = len(handle.keys)
        if isinstance(handle, StoreHandle):
            loop = asyncio.get_running_loop()
            ttl = self.ctx.limits.store_lease_ttl_s
            self._expiry[lease] = loop.call_later(ttl, self._expire, lease)
        return lease

    def _end(self, lease: int) -> Lease:
        """Forget ``lease`` (the caller finishes its handle): its blocks are free."""
        handle = self.leases.pop(lease)
        self._give(self._held_by_lease.pop(lease, 0))
        timer = self._expiry.pop(lease, None)
        if timer is not None:
            timer.cancel()
        return handle

    def _expire(self, lease: int) -> None:
        """A store lease outlived ``store_lease_ttl_s``: abort it, free its slots."""
        self._expiry.pop(lease, None)
        if lease not in self.leases:
            return
        handle = self._end(lease)
        _finish(handle)
        self._expired[lease] = None
        if len(self._expired) > _EXPIRED_MEMORY:
            del self._expired[next(iter(self._expired))]
        if self.tenant is not None:
            self.tenant.leases_expired += 1
        log.info(
            "store lease expired",
            conn=self.conn,
            lease=lease,
            blocks=len(handle.keys),
            ttl_s=self.ctx.limits.store_lease_ttl_s,
        )

    def _lease_of(self, msg: dict[str, Any], kind: type[_H]) -> tuple[int, _H]:
        """The lease named by ``msg``, which must be of ``kind`` and held here."""
        lease = int_field(msg, "lease")
        handle = self.leases.get(lease)
        if not isinstance(handle, kind):
            what = "store" if kind is StoreHandle else "load"
            if lease in self._expired and kind is StoreHandle:
                ttl = self.ctx.limits.store_lease_ttl_s
                message = (
                    f"store lease {lease} expired: it was not finished within {ttl} s"
                    " (limits.store_lease_ttl_s), and its slots were freed"
                )
            else:
                message = f"lease {lease} is not a {what} lease held by this connection"
            raise ProtocolError(message, code=ErrorCode.UNKNOWN_LEASE)
        return lease, handle

    # -- events -----------------------------------------------------------------------

    def _subscribe(self, msg: dict[str, Any]) -> Reply:
        if self._stream is None:
            if self.tenant is not None and not (self.grant.operator and self.namespace is None):
                chains = [(self.tenant.name, self.tenant.chain)]
            else:  # an operator without a namespace follows every tenant
                chains = [(t.name, t.chain) for t in self.ctx.tenants.tenants]
            self._stream = EventStream(
                chains,
                prefix=self.prefix,
                queue_batches=self.ctx.event_queue_batches,
                writable=self.writable,
                send=self.send,
                is_closed=lambda: self.closed,
            )
        return {}

    def _unsubscribe(self, msg: dict[str, Any]) -> Reply:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        return {}

    # -- end of life ------------------------------------------------------------------

    def close(self) -> None:
        """The connection is gone: release every lease; running requests release theirs
        when they end."""
        if self.closed:
            return
        self.closed = True
        self._unsubscribe({})
        for lease in list(self.leases):
            _finish(self._end(lease))


def _finish(handle: Lease) -> None:
    if isinstance(handle, StoreHandle):
        handle.abort()
    else:
        handle.release()


def _distinct(keys: list[BlockKey]) -> list[BlockKey]:
    if len(set(keys)) != len(keys):
        raise ProtocolError("a key appears twice in one store", code=ErrorCode.BAD_REQUEST)
    return keys


def _leading(flags: list[bool]) -> int:
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)


def _error_code(exc: Exception) -> ErrorCode:
    if isinstance(exc, ProtocolError):
        codes = {str(code): code for code in ErrorCode}
        return codes.get(exc.code, ErrorCode.BAD_REQUEST)
    if isinstance(exc, CapacityError):
        return ErrorCode.CAPACITY
    if isinstance(exc, StoreIOError | TransferError):
        return ErrorCode.IO_ERROR
    if isinstance(exc, ResourceClosed):
        return ErrorCode.SHUTTING_DOWN
    if isinstance(exc, TierdError):
        return ErrorCode.BAD_REQUEST
    return ErrorCode.INTERNAL
