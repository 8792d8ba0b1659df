"""The requests of KV events (docs/events.md): ``describe`` and ``blocks_held``.

- ``describe``: a namespaced client says what its blocks are, in its engine's terms (one
  description per key, :mod:`tierd.kvevents.describe`), so that their events carry what a
  router indexes. A block already held is announced at once. Without a ``kv_events:``
  section publishing the tenant, the answer is ``kept: 0`` and nothing is kept. A
  description costs the loop time to check and keep, more the bigger it is, so a request
  is handled :data:`DESCRIPTIONS` descriptions a turn and at most
  :data:`DESCRIPTION_BYTES` of them (a bound on their number alone would let big
  descriptions hold every other client); all are checked before any is kept.
- ``blocks_held``: the existence query of routers that ask instead of listen: lists of
  engine block hashes in (one list per request, prefix order), for each the number of
  leading blocks the node holds and the medium of each, in one tenant's blocks: a tenant's
  connection asks its own tenant's; an operator's connection without a namespace asks the
  one ``tenant`` names (it may leave it out when one tenant is published). The tenant's
  index of hashes is built at its first ``blocks_held``, a part of its book a turn (the
  request waits for it; nobody else does). A tenant's descriptions credit only its own
  blocks: answering for every tenant at once, a tenant that described its blocks with
  another's hashes made the node look as if it held the other's prefix.
"""

from __future__ import annotations

from itertools import accumulate, pairwise
from typing import TYPE_CHECKING, Any, Protocol

from tierd.control.protocol import ErrorCode, opt_str_field
from tierd.control.state.context import ServerContext
from tierd.control.state.tenant_table import Grant, Tenant
from tierd.errors import ProtocolError
from tierd.keys import BlockKey
from tierd.kvevents.describe import BadDescription, parse_description
from tierd.turns import DESCRIPTION_BYTES, DESCRIPTIONS, next_turn

if TYPE_CHECKING:
    from tierd.kvevents.feed import KvTenant

__all__ = ["KvRequests"]


Reply = dict[str, Any]


class Asker(Protocol):
    """What the KV-event requests ask of the session."""

    @property
    def grant(self) -> Grant: ...

    @property
    def tenant(self) -> Tenant | None: ...

    @property
    def namespace(self) -> str | None: ...

    def keys(self, msg: dict[str, Any], name: str = "keys") -> list[BlockKey]: ...


class KvRequests:
    """``describe`` and ``blocks_held`` for one session."""

    def __init__(self, ctx: ServerContext, asker: Asker) -> None:
        self.ctx = ctx
        self.asker = asker

    async def describe(self, msg: dict[str, Any]) -> Reply:
        keys = self.asker.keys(msg)
        blocks = msg.get("blocks")
        if not isinstance(blocks, list) or len(blocks) != len(keys):
            raise _bad(f"field 'blocks' must be a list of {len(keys)} descriptions (one per key)")
        tenant = self.asker.tenant
        feed = self.ctx.kv_feed
        published = None if feed is None or tenant is None else feed.tenants.get(tenant.name)
        if published is None:
            return {"kept": 0}
        pieces = _pieces(blocks)
        entries = []
        for n, piece in enumerate(pieces):
            if n:
                await next_turn()
            try:
                entries += [parse_description(raw) for raw in blocks[piece]]
            except BadDescription as exc:
                raise _bad(f"a description: {exc}") from None
        for piece in pieces:
            if len(pieces) > 1:  # (a request of one piece is one turn)
                await next_turn()
            feed.described(published, keys[piece], entries[piece])  # type: ignore[union-attr]
        return {"kept": len(entries)}

    async def blocks_held(self, msg: dict[str, Any]) -> Reply:
        requests = _requests(msg, self.ctx.max_keys)
        tenant = self._asked(msg)
        if tenant is None:
            return {"held": [0] * len(requests), "media": [[] for _ in requests]}
        book = tenant.book
        while not book.index_part():  # the hash index, at the first ask: a part a turn
            await next_turn()
        answers = [book.held(hashes, tenant.top_medium) for hashes in requests]
        return {"held": [len(m) for m in answers], "media": answers}

    def _asked(self, msg: dict[str, Any]) -> KvTenant | None:
        feed = self.ctx.kv_feed
        if feed is None:
            raise ProtocolError(
                "KV events are off: turn them on in the kv_events: section",
                code=ErrorCode.BAD_REQUEST,
            )
        named = opt_str_field(msg, "tenant")
        grant, asker = self.asker.grant, self.asker
        if grant.operator and asker.namespace is None:
            if named is None and len(feed.tenants) == 1:
                (only,) = feed.tenants.values()
                return only
            if named is None:
                names = ", ".join(map(repr, feed.tenants)) or "none"
                raise _bad(
                    "name the tenant whose blocks you ask for (field 'tenant'): a tenant's"
                    f" descriptions credit only its own blocks (published: {names})"
                )
            if named not in feed.tenants:
                raise _bad(f"tenant {named!r} is not published (kv_events.tenants)")
            return feed.tenants[named]
        tenant = asker.tenant
        if tenant is None:
            raise ProtocolError(f"{grant.label} may not ask", code=ErrorCode.NOT_ALLOWED)
        if named is not None and named != tenant.name:
            raise ProtocolError(
                f"tenant {tenant.name!r} may not ask for {named!r}'s blocks",
                code=ErrorCode.NOT_ALLOWED,
            )
        return feed.tenants.get(tenant.name)


def _requests(msg: dict[str, Any], max_keys: int) -> list[list[Any]]:
    """The requests of ``blocks_held``: ``hashes`` (all of them, one list: a frame holds
    few containers) cut at ``lengths`` (how many hashes each request has)."""
    hashes, lengths = msg.get("hashes"), msg.get("lengths")
    if not isinstance(hashes, list) or not isinstance(lengths, list):
        raise _bad("fields 'hashes' and 'lengths' must be lists (all hashes; one length each)")
    if len(hashes) > max_keys:
        raise ProtocolError(
            f"{len(hashes)} hashes in one request, the limit is {max_keys}",
            code=ErrorCode.TOO_MANY_KEYS,
        )
    if not all(type(n) is int and n >= 0 for n in lengths) or sum(lengths) != len(hashes):
        raise _bad("'lengths' must be counts adding up to the number of hashes")
    if not all(type(h) in (int, bytes) for h in hashes):
        raise _bad("a block hash is an integer or bytes")
    return [hashes[start:end] for start, end in pairwise(accumulate(lengths, initial=0))]


def _pieces(blocks: list[Any]) -> list[slice]:
    """``blocks`` (packed descriptions) cut into the pieces of one turn each: at most
    :data:`DESCRIPTIONS` of them and :data:`DESCRIPTION_BYTES` of their bytes, one at
    least (a description that is not bytes fails its check in the first piece)."""
    pieces: list[slice] = []
    start = size = 0
    for i, raw in enumerate(blocks):
        grown = size + (len(raw) if isinstance(raw, bytes | bytearray) else 0)
        if i > start and (i - start >= DESCRIPTIONS or grown > DESCRIPTION_BYTES):
            pieces.append(slice(start, i))
            start, grown = i, grown - size
        size = grown
    if start < len(blocks) or not blocks:
        pieces.append(slice(start, len(blocks)))
    return pieces


def _bad(message: str) -> ProtocolError:
    return ProtocolError(message, code=ErrorCode.BAD_REQUEST)
