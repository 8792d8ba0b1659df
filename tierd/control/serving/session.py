"""One client connection's view of the chain: its namespace, its leases, its requests.

A :class:`Session` turns decoded requests into chain calls and replies; it owns no
socket (the connection hands it messages and a ``send`` callback), so every rule of the
protocol can be exercised without one. It owns the dispatch, the namespace, ``lookup``
and ``touch`` (the fast path) and the event stream; hello's checks are in ``hello``,
the requests that move blocks in ``block_requests``, the operator's (``clear``,
``flush``, ``stop``, ``config``, ``metrics``, ``reload``) in ``operator_requests``, by
namespace (``namespaces``, ``inspect``, ``delete``) in ``namespace_requests``, and KV
events' (``describe``, ``blocks_held``) in ``kv_requests`` (all in ``tierd.control``).

- **Tenants.** The connection's :class:`~tierd.control.state.tenant_table.Grant` (decided by the
  server from the peer's kernel credentials, never from what the client says) names its
  tenant: every data operation goes to that tenant's chain and no other.
- **Namespaces.** ``hello`` names the client's namespace, one of its tenant's patterns;
  every key the client sends is prefixed with the namespace's 8-byte id, and stripped
  from the events it receives, so blocks of different namespaces never collide.
- **Pool.** ``hello`` with ``pool_fd: true`` gets the tenant's pool descriptor with its
  reply (SCM_RIGHTS); no pool has a path to open.
- **Leases.** ``prepare_store`` and ``prepare_load`` hand out lease ids only this
  session can finish, bounded and expired by its :class:`~tierd.control.requests.leases.Leases`.
  :meth:`close` aborts and releases every lease left, and a request still running gives
  its lease back when it ends: a client that dies never leaks a pin or a slot.
- **Errors.** A bad request gets an error reply and changes nothing; an unexpected one
  is logged with its traceback and answered ``internal``.
- **Replies in pieces.** A get's reply (up to a frame of blocks) is written a piece a
  turn of the loop as the client's socket takes it; the session's other messages wait
  behind it, so no frame is cut into.
- **Timing.** Every answered request of a known operation is timed from its arrival to
  its reply into ``ctx.timing`` (latency histograms, per-request debug lines); work an
  answer hands back (a big load's unpin, in pieces) is a task, timed when it replies.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from tierd.chain import LookupResult, TierChain
from tierd.control.engine_regions.registration import FdLine
from tierd.control.engine_regions.requests import RegionRequests
from tierd.control.figures.namespaces import NamespaceFigures
from tierd.control.protocol import (
    FRAME_PIECE,
    ErrorCode,
    error_code_of,
    error_reply,
    int_field,
    prefixed_keys,
)
from tierd.control.requests.block_requests import LOADED_FROM, BlockRequests
from tierd.control.requests.event_stream import EventStream
from tierd.control.requests.frame_pieces import EncodedBins, frame_in_pieces
from tierd.control.requests.hello import answer_hello, open_size, size_to_open
from tierd.control.requests.kv_requests import KvRequests
from tierd.control.requests.leases import Leases
from tierd.control.requests.namespace_requests import NamespaceRequests
from tierd.control.requests.operator_requests import OperatorRequests
from tierd.control.state.context import ServerContext
from tierd.control.state.tenant_table import Grant, Tenant
from tierd.errors import ProtocolError
from tierd.keys import BlockKey
from tierd.turns import next_turn

__all__ = ["Session"]

log = structlog.get_logger("tierd.control")

Reply = dict[str, Any]
_Answer = Callable[[dict[str, Any]], Reply | Awaitable[Reply]]  # at once, or work for a task
_Start = Callable[[dict[str, Any]], Awaitable[Reply]]  # one run as a task
_MAX_ID = (1 << 64) - 1
# Refused while the daemon drains; finishing a lease (complete_store) is still allowed.
_STARTS_WORK = frozenset(
    {"prepare_store", "prepare_load", "put", "get", "flush", "register_region"}
    | {"region_store", "region_load"}
)


class Session:
    """Requests from one client; ``send`` writes a message back to it, and a region's
    descriptor comes on ``line`` (the connection's)."""

    def __init__(
        self,
        ctx: ServerContext,
        send: Callable[[dict[str, Any]], None],
        conn: int = 0,
        grant: Grant | None = None,
        line: FdLine | None = None,
    ) -> None:
        self.ctx = ctx
        self._write = send  # the connection's: one message, or a piece of a frame
        self._held: list[dict[str, Any]] | None = None  # sent while a reply is in pieces
        self._in_pieces = asyncio.Lock()  # one reply in pieces at a time
        self.conn = conn  # the connection's id, in debug lines
        self.grant = Grant(None, False)  # no rights until admitted
        self.tenant: Tenant | None = None
        self.greeted = False
        self._greeting = False  # a hello waits for its block size's chain to open
        self.opening_size: int | None = None  # that block size, meanwhile
        self.namespace: str | None = None
        self.prefix = b""
        self.figures = NamespaceFigures()  # its namespace's, once hello names one
        self.leases = Leases(ctx, conn)
        self.tasks: set[asyncio.Task[None]] = set()
        self.closed = False
        self._stream: EventStream | None = None
        self._line = line  # the connection descriptors come on (None: they cannot)
        self.writable = asyncio.Event()  # cleared while the client's socket is full
        self.writable.set()
        self._sync, self._async = self._operations()
        if grant is not None:
            self.admit(grant)

    def _operations(self) -> tuple[dict[str, _Answer], dict[str, _Start]]:
        """The handler of every operation: those answered at once, those run as tasks."""
        ctx = self.ctx
        blocks = self._blocks = BlockRequests(ctx, self, self.leases)
        operator = OperatorRequests(ctx, self)
        self.regions = RegionRequests(ctx, self, blocks, self._line)
        by_namespace = NamespaceRequests(ctx, self)
        kv = KvRequests(ctx, self)
        answered: dict[str, _Answer] = {
            "hello": self._hello,
            "lookup": self._lookup,
            "lookup_each": self._lookup_each,
            "touch": blocks.touch,
            "complete_load": blocks.complete_load,  # a big load's unpin: a task, in pieces
            "abort_store": blocks.abort_store,
            "subscribe": self._subscribe,
            "unsubscribe": self._unsubscribe,
            "stop": operator.stop,
            "stats": lambda msg: {
                "stats": ctx.stats(self.grant, namespaces=msg.get("namespaces") is True)
            },
            "health": lambda msg: ctx.health(),
            "config": operator.config,
            "metrics": operator.metrics,
            "unregister_region": self.regions.unregister,
            "namespaces": by_namespace.namespaces,
            "inspect": by_namespace.inspect,
            "trace": operator.trace,
        }
        started: dict[str, _Start] = {
            "prepare_store": blocks.prepare_store,
            "complete_store": blocks.complete_store,
            "prepare_load": self._prepare_load,
            "put": blocks.put,
            "get": blocks.get,
            "flush": operator.flush,
            "clear": operator.clear,  # in pieces: a task
            "sizes": operator.sizes,  # a size given back is cleared in pieces: a task
            "reload": operator.reload,  # reads a file: off the loop, so a task
            "register_region": self.regions.registrations.register,
            "region_store": self.regions.store,
            "region_load": self.regions.load,
            "delete": by_namespace.delete,
            "describe": kv.describe,  # in pieces, the loop's turn between them
            "blocks_held": kv.blocks_held,  # the first builds the hash index, in pieces
        }
        return answered, started

    def admit(self, grant: Grant) -> None:
        """The peer is ``grant``'s (decided by the server from its credentials)."""
        self.grant = grant
        self.tenant = self.leases.tenant = grant.tenant
        if self.tenant is not None and self.tenant.chain.remote is not None:
            self._sync.pop("lookup", None)  # a lookup asks the remote level too
            self._async["lookup"] = self._find
            self._sync.pop("lookup_each", None)
            self._async["lookup_each"] = self._find_each

    # -- dispatch ---------------------------------------------------------------------

    def handle(self, msg: Any) -> asyncio.Task[None] | None:
        """Answer one decoded message (a :class:`ProtocolError` for an undecodable one);
        returns the task answering it, where its answer comes later."""
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
                        if not isinstance(fields, dict):
                            # timed when it replies
                            return self._spawn(request_id, fields, op, msg, started)
                        self._reply(request_id, fields)
                        result = "ok"
                    self.ctx.timing.observe(self.conn, op, msg, started, result)
                    return None
        return self._dispatch(msg, started)

    def _dispatch(self, msg: Any, started: int) -> asyncio.Task[None] | None:
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
            opening = size_to_open(self.ctx, self.tenant, msg) if op == "hello" else None
            if opening is not None:  # a block size the tenant serves from now on
                hello = self._hello_at_new_size(msg, opening)
                return self._spawn(request_id, hello, op, msg, started)
            sync = self._sync.get(op)
            if sync is not None:
                fields = sync(msg)
                if not isinstance(fields, dict):
                    return self._spawn(request_id, fields, op, msg, started)  # timed at reply
                self._reply(request_id, fields)
            elif op in self._async:
                return self._spawn(request_id, self._async[op](msg), op, msg, started)
            else:
                raise ProtocolError(f"unknown op {op[:64]!r}", code=ErrorCode.UNKNOWN_OP)
        except Exception as exc:  # every failure becomes a reply; cancellation propagates
            result = self._fail(request_id, exc)
        else:
            result = "ok"
        if known is not None:
            self.ctx.timing.observe(self.conn, known, msg, started, result)
        return None

    def _spawn(
        self, request_id: int, work: Awaitable[Reply], op: str, msg: Reply, started: int
    ) -> asyncio.Task[None]:
        async def run() -> None:
            medium = None
            try:
                reply = await work
            except Exception as exc:
                result = self._fail(request_id, exc)
            else:
                medium = reply.pop(LOADED_FROM, None)
                if isinstance(reply.get("data"), EncodedBins):
                    await self._reply_in_pieces(request_id, reply)
                else:
                    self._reply(request_id, reply)
                result = "ok"
            self.ctx.timing.observe(self.conn, op, msg, started, result, medium)

        task = asyncio.get_running_loop().create_task(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def send(self, message: dict[str, Any]) -> None:
        """Write ``message`` to the client; while a reply goes out in pieces, after it."""
        if self._held is None:
            self._write(message)
        else:
            self._held.append(message)

    async def _reply_in_pieces(self, request_id: int, fields: Reply) -> None:
        """A reply whose ``data`` is encoded already, in pieces (a get's blocks), written a
        piece a turn of the loop, each once the client's socket has room (so it never
        holds much more than a piece unsent); the session's other messages wait until the
        frame is whole. Cancelled, the rest of the frame goes at once."""
        async with self._in_pieces:
            pieces = deque(frame_in_pieces({"id": request_id, "ok": True, **fields}))
            held: list[dict[str, Any]] = []
            self._held, first = held, True
            try:
                while pieces and not self.closed:
                    if not first:
                        await next_turn()
                        await self.writable.wait()
                        if self.closed:
                            break
                    self._write({FRAME_PIECE: pieces.popleft()})  # each freed once written
                    first = False
            finally:
                self._held = None
                if not self.closed:
                    while pieces:
                        self._write({FRAME_PIECE: pieces.popleft()})
                    for message in held:
                        self._write(message)

    def _reply(self, request_id: int, fields: Reply) -> None:
        if not self.closed:
            self.send({"id": request_id, "ok": True, **fields})

    def _fail(self, request_id: int, exc: Exception) -> str:
        """Answer ``exc`` as an error reply; returns its code."""
        code = error_code_of(exc)
        if code is ErrorCode.INTERNAL:
            log.error("request failed", namespace=self.namespace, exc_info=exc)
        self.ctx.count_error(code)
        if not self.closed:
            self.send(error_reply(request_id, code, str(exc) or type(exc).__name__))
        return str(code)

    # -- handshake and namespace ------------------------------------------------------

    def _hello(self, msg: dict[str, Any]) -> Reply:
        self._hello_not_yet()
        greeted = answer_hello(self.ctx, self.tenant, msg)
        self.tenant = self.leases.tenant = greeted.tenant  # the tenant at its block size
        if self.tenant is not None:
            self.tenant.greeted()  # a size in use is never given back
        self.namespace, self.prefix = greeted.namespace, greeted.prefix
        if greeted.namespace is not None and self.tenant is not None:
            self.figures = self.tenant.book.learn(greeted.namespace, greeted.prefix)
        self.greeted = True
        return greeted.reply

    async def _hello_at_new_size(self, msg: dict[str, Any], block_bytes: int) -> Reply:
        """Hello naming a block size its tenant has room for but has not opened: the
        size's chain opens first (once, whoever asks), then hello is answered as ever."""
        self._hello_not_yet()
        self._greeting, self.opening_size = True, block_bytes
        try:
            await open_size(self.tenant, block_bytes)
        finally:
            self._greeting, self.opening_size = False, None
        return self._hello(msg)

    def _hello_not_yet(self) -> None:
        if self.greeted or self._greeting:
            raise ProtocolError("hello was already sent", code=ErrorCode.BAD_REQUEST)

    def chain(self) -> TierChain:
        """The chain of this connection's tenant."""
        if self.tenant is None:
            raise ProtocolError(
                "this user belongs to no tenant: it keeps no blocks",
                code=ErrorCode.NOT_ALLOWED,
            )
        return self.tenant.chain

    def keys(self, msg: dict[str, Any], name: str = "keys") -> list[BlockKey]:
        """The keys of ``msg``'s field ``name``, each prefixed with the namespace's id."""
        if self.namespace is None:
            self.chain()  # a user of no tenant is told that first
            raise ProtocolError(
                "data operations need a namespace: name one in hello",
                code=ErrorCode.NAMESPACE_REQUIRED,
            )
        return prefixed_keys(self.prefix, msg, name, self.ctx.max_keys, self.ctx.max_key_bytes)

    # -- queries (the fast path) ------------------------------------------------------

    def _lookup(self, msg: dict[str, Any]) -> Reply:
        keys = self.keys(msg)
        self._record(msg)
        return self._lookup_reply(self.chain().lookup(keys), len(keys))

    async def _find(self, msg: dict[str, Any]) -> Reply:
        keys = self.keys(msg)
        self._record(msg)
        return self._lookup_reply(await self.chain().find(keys), len(keys))

    async def _prepare_load(self, msg: dict[str, Any]) -> Reply:
        """``prepare_load``; with ``lookup: true`` counted as a lookup of its keys first
        (hits by level, the namespace's figures, the trace recorder): an engine whose
        lookups are its pins (tierd's pool as vLLM's CPU tier) sends no other."""
        if msg.get("lookup") is True:
            self._lookup(msg)
        return await self._blocks.prepare_load(msg)

    def _record(self, msg: dict[str, Any]) -> None:
        """Hand a (validated) lookup to the trace recorder: one lookup is one request."""
        recorder = self.ctx.recorder
        if recorder is not None and recorder.enabled and self.tenant is not None:
            recorder.record(self.tenant.name, self.prefix, msg["keys"])

    def _lookup_each(self, msg: dict[str, Any]) -> Reply:
        keys = self.keys(msg)
        self._record(msg)
        return self._each_reply(self.chain().holds(keys))

    async def _find_each(self, msg: dict[str, Any]) -> Reply:
        keys = self.keys(msg)
        self._record(msg)
        return self._each_reply(await self.chain().find_each(keys))

    def _each_reply(self, present: list[bool]) -> Reply:
        self.figures.count_lookup(len(present), present.count(True))
        return {"present": present}

    def _lookup_reply(self, result: LookupResult, asked: int) -> Reply:
        self.figures.count_lookup(asked, result.count)
        return {
            "count": result.count,
            "media": list(result.media),  # StrEnum values pack as msgpack str
            "in_flight": result.in_flight,
        }

    # -- events -----------------------------------------------------------------------

    def _subscribe(self, msg: dict[str, Any]) -> Reply:
        if self._stream is None:
            if self.tenant is not None and not (self.grant.operator and self.namespace is None):
                chains = [(self.tenant.name, self.tenant.chain)]
            else:  # an operator without a namespace follows every tenant
                chains = [(t.name, t.chain) for t in self.ctx.tenants.every()]
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
        self.leases.close()
        self.regions.close()
        if self.greeted and self.tenant is not None:
            self.tenant.left()
