"""The cache by namespace: ``namespaces`` (list them), ``inspect`` (where one key lives)
and ``delete`` (by keys, by key prefix, or a whole namespace).

Who may act where:

- A member acts in its own tenant only, on a namespace its tenant may use: the one its
  hello named (the default), or another named by ``namespace`` that matches its
  tenant's patterns. Naming another ``tenant`` needs an operator.
- An operator may name any ``tenant`` (default: every tenant) and any namespace, by
  ``namespace`` (its name: the id is derived from it, so a retired model's blocks can be
  deleted by name even after a restart) or ``namespace_id`` (16 hex digits, as
  ``namespaces`` lists an id whose name is not known).

``delete`` keeps every level consistent: :meth:`~tierd.chain.TierChain.delete` removes a
key from every tier at once (``Removed`` events, and a disk tier forgets it across a
restart), and keeps a key whole while any tier is writing or reading it (pinned by a
lease): those are counted ``busy``, to be asked again. A namespace or prefix is deleted
by walking each level's keys in slices, yielding to the event loop between them, so
other clients are served while a large namespace goes; one tenant's walks run one at a
time. ``namespaces`` costs the number of namespaces, not of blocks (the chain's census).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from tierd.chain import Deleted
from tierd.control.figures.namespaces import namespace_rows
from tierd.control.protocol import NAMESPACE_ID_BYTES, ErrorCode, keys_field, opt_str_field
from tierd.control.state.context import ServerContext
from tierd.control.state.tenant_table import Grant, Tenant
from tierd.errors import ProtocolError
from tierd.keys import MAX_KEY_BYTES, BlockKey
from tierd.turns import INDEX_KEYS, next_turn

__all__ = ["INDEX_KEYS", "NamespaceRequests"]

Reply = dict[str, Any]


class Asker(Protocol):
    """What the namespace requests ask of the session."""

    @property
    def grant(self) -> Grant:
        """The connection's rights, from its peer's credentials."""
        ...

    @property
    def namespace(self) -> str | None:
        """The namespace named in hello (None: none was)."""
        ...

    @property
    def prefix(self) -> bytes:
        """That namespace's id (empty without one)."""
        ...


class NamespaceRequests:
    """``namespaces``, ``inspect`` and ``delete`` for one session."""

    def __init__(self, ctx: ServerContext, asker: Asker) -> None:
        self.ctx = ctx
        self.asker = asker

    # -- who and where ----------------------------------------------------------------

    def _tenants(self, msg: dict[str, Any]) -> list[Tenant]:
        """The tenants a request acts on: a member's own; an operator's named one, or all."""
        grant = self.asker.grant
        name = opt_str_field(msg, "tenant")
        if name is not None:
            tenant = self.ctx.tenants.named(name)
            if tenant is None:
                known = ", ".join(t.name for t in self.ctx.tenants.tenants)
                raise ProtocolError(
                    f"no tenant named {name!r} ({known})", code=ErrorCode.BAD_REQUEST
                )
            if tenant is grant.tenant or grant.operator:
                return [tenant]
            raise ProtocolError(
                f"tenant {grant.label} may not act on tenant {name!r}: that needs an operator",
                code=ErrorCode.NOT_ALLOWED,
            )
        if grant.operator:
            return list(self.ctx.tenants.tenants)
        if grant.tenant is None:
            raise ProtocolError(
                "this user belongs to no tenant: it keeps no blocks", code=ErrorCode.NOT_ALLOWED
            )
        return [grant.tenant]

    def _namespace(self, msg: dict[str, Any], tenants: list[Tenant]) -> bytes:
        """The id of the namespace a request names (default: the connection's own)."""
        name = opt_str_field(msg, "namespace", max_len=1024)
        hex_id = opt_str_field(msg, "namespace_id", max_len=2 * NAMESPACE_ID_BYTES)
        if name is not None and hex_id is not None:
            raise ProtocolError(
                "name a namespace by 'namespace' or by 'namespace_id', not both",
                code=ErrorCode.BAD_REQUEST,
            )
        if name is None and hex_id is None:
            if not self.asker.prefix:
                raise ProtocolError(
                    "name a namespace ('namespace' or 'namespace_id'): this connection has none",
                    code=ErrorCode.BAD_REQUEST,
                )
            return self.asker.prefix
        if hex_id is not None:
            try:
                namespace_id = bytes.fromhex(hex_id)
            except ValueError:
                namespace_id = b""
            if len(namespace_id) != NAMESPACE_ID_BYTES:
                raise ProtocolError(
                    f"namespace_id must be {2 * NAMESPACE_ID_BYTES} hex digits",
                    code=ErrorCode.BAD_NAMESPACE,
                )
        else:
            namespace_id = self.ctx.namespace_id(name or "")
        grant = self.asker.grant
        if not grant.operator and namespace_id != self.asker.prefix:
            problem = None if name is None else tenants[0].namespace_problem(name)
            if name is None or problem is not None:
                raise ProtocolError(
                    problem or "a member names another namespace by its name, not its id",
                    code=ErrorCode.NOT_ALLOWED,
                )
        return namespace_id

    # -- the requests -----------------------------------------------------------------

    def namespaces(self, msg: dict[str, Any]) -> Reply:
        tenants = self._tenants(msg)
        return {
            "tenants": {
                t.name: namespace_rows(t.book, *(s.chain for s in t.each_size())) for t in tenants
            }
        }

    def inspect(self, msg: dict[str, Any]) -> Reply:
        tenants = self._tenants(msg)
        namespace_id = self._namespace(msg, tenants)
        key = msg.get("key")
        if type(key) is not bytes or not 0 < len(key) <= _key_room():
            raise ProtocolError(
                f"field 'key' must be bin of 1 to {_key_room()} bytes", code=ErrorCode.BAD_KEY
            )
        full = BlockKey(namespace_id + key)
        found = []
        for tenant in (sized for t in tenants for sized in t.each_size()):
            for tier, medium, state, slot in tenant.chain.holders(full):
                found.append(
                    {
                        "tenant": tenant.name,
                        "tier": tier,
                        "medium": medium,
                        "state": state,
                        "slot": slot,
                        "block_bytes": tenant.block_bytes,
                    }
                )
        figures = tenants[0].book.figures.get(namespace_id) if len(tenants) == 1 else None
        return {
            "namespace": _label(tenants, namespace_id),
            "namespace_id": namespace_id.hex(),
            "bytes": found[0]["block_bytes"] if found else 0,
            "tiers": found,
            "namespace_last_used": figures.last_used if figures and figures.last_used else None,
            # Whether any tenant asked knows the namespace (named it, or holds its blocks).
            "namespace_known": any(namespace_id in t.book.figures for t in tenants),
        }

    async def delete(self, msg: dict[str, Any]) -> Reply:
        tenants = self._tenants(msg)
        namespace_id = self._namespace(msg, tenants)
        chosen = [name for name in ("keys", "prefix", "all") if msg.get(name) is not None]
        if len(chosen) != 1:
            raise ProtocolError(
                "delete takes exactly one of 'keys' (a list), 'prefix' (bin) or 'all' (true)",
                code=ErrorCode.BAD_REQUEST,
            )
        removed = busy = 0
        if chosen[0] == "keys":
            keys = keys_field(
                msg, max_keys=self.ctx.max_keys, max_key_bytes=_key_room(), name="keys"
            )
            full = [BlockKey(namespace_id + key) for key in keys]
            for tenant in (sized for t in tenants for sized in t.each_size()):
                done = await tenant.chain.delete_in_pieces(full)
                removed, busy = removed + done.removed, busy + done.busy
        else:
            start = namespace_id + self._prefix(msg, chosen[0])
            for tenant in (sized for t in tenants for sized in t.each_size()):
                # One walk of a tenant's index at a time: a second waits for the first.
                async with tenant.book.walking:
                    done = await _delete_starting(tenant, start)
                removed, busy = removed + done.removed, busy + done.busy
        return {
            "removed": removed,
            "busy": busy,
            "namespace": _label(tenants, namespace_id),
            "tenants": [t.name for t in tenants],
        }

    @staticmethod
    def _prefix(msg: dict[str, Any], mode: str) -> bytes:
        """What a ``prefix`` or ``all`` delete adds to the namespace's id."""
        if mode == "all":
            if msg["all"] is not True:
                raise ProtocolError("'all' must be true", code=ErrorCode.BAD_REQUEST)
            return b""
        prefix = msg["prefix"]
        if type(prefix) is not bytes or not 0 < len(prefix) <= _key_room():
            raise ProtocolError(
                f"'prefix' must be bin of 1 to {_key_room()} bytes", code=ErrorCode.BAD_KEY
            )
        return bytes(prefix)


async def _delete_starting(tenant: Tenant, start: bytes) -> Deleted:
    """Delete every key of ``tenant`` that starts with ``start`` (a namespace id and
    more), walking each level's keys :data:`INDEX_KEYS` at a time and yielding to the
    loop between slices, so other clients are served while a large namespace goes. A
    key stored after its level's keys were taken stays; one evicted meanwhile is skipped."""
    chain = tenant.chain
    census = chain.prefix_census(NAMESPACE_ID_BYTES)
    namespace_id, size = start[:NAMESPACE_ID_BYTES], len(start)
    handled: set[BlockKey] = set()  # a key held by two levels is deleted (or busy) once
    removed = busy = 0
    for index, level in enumerate(chain.levels):
        tier = level.tier
        if census.held(index, namespace_id) or tier.adopting:
            # Copies at C speed, a part of the index at a time (kept blocks not adopted
            # yet included: they are in no census, nor are the ones adopted so far).
            key_parts: Iterable[list[BlockKey]] = tier.key_parts()
        else:  # no ready block of the namespace there: only its writes in flight can be
            key_parts = [tier.writing_keys()]
        for keys in key_parts:
            for first in range(0, len(keys), INDEX_KEYS):
                part = keys[first : first + INDEX_KEYS]
                found = [k for k in part if k[:size] == start and k not in handled]
                if found:
                    done = await chain.delete_in_pieces(found)
                    removed, busy = removed + done.removed, busy + done.busy
                    handled.update(found)
                await next_turn()  # a large namespace goes without stalling others
    return Deleted(removed, busy)


def _key_room() -> int:
    return MAX_KEY_BYTES - NAMESPACE_ID_BYTES


def _label(tenants: list[Tenant], namespace_id: bytes) -> str | None:
    return next((n for t in tenants if (n := t.book.label(namespace_id)) is not None), None)
