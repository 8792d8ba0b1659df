"""The operator's requests of the control socket's client: figures, flush, namespaces,
deletes, reload, and the engine descriptions and block queries that routers use.

This module owns :class:`ControlRequests`, the part of :class:`~tierd.control.clients.client.Client`
that asks the daemon about its state or changes it as a whole (rather than moving a
connection's blocks), and :class:`Flushed`, a flush's reply. It holds no state: each
method is one request through :meth:`ControlRequests.request`, which the client supplies.
Every public name is importable from :mod:`tierd.control.clients.client`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

__all__ = ["ControlRequests", "Flushed"]


@dataclass(frozen=True, slots=True)
class Flushed:
    """A flush's reply: blocks ``copied`` down, blocks still ``dirty`` (per tier), and why;
    with a remote level, the blocks sent to it and those that did not land (per level, by
    cause), and why."""

    copied: int
    dirty: int
    dirty_by_tier: dict[str, int]
    reason: str
    remote_sent: int = 0
    remote_missed: int = 0
    remote_missed_by_level: dict[str, dict[str, int]] = field(default_factory=dict)
    remote_reason: str = ""

    @property
    def failed(self) -> bool:
        """Whether blocks were left behind: dirty, or not landed on the remote level."""
        return self.dirty > 0 or self.remote_missed > 0


class ControlRequests:
    """The daemon's figures and operator's commands, one request each; a subclass sends
    them (:meth:`request`)."""

    async def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply (the client's connection does)."""
        raise NotImplementedError

    async def stats(self, *, namespaces: bool = False) -> dict[str, Any]:
        """The daemon's figures; with ``namespaces``, each tenant's namespaces too."""
        fields = {"namespaces": True} if namespaces else {}
        return dict((await self.request("stats", **fields))["stats"])

    async def health(self) -> dict[str, Any]:
        reply = await self.request("health")
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    async def config(self) -> dict[str, Any]:
        return dict((await self.request("config"))["config"])

    async def metrics(self) -> str:
        return str((await self.request("metrics"))["text"])

    async def flush(self) -> Flushed:
        """Copy every dirty block down; what stayed dirty, and why, is in the result."""
        reply = await self.request("flush")
        by_level = reply.get("remote_missed_by_level") or {}
        return Flushed(
            copied=int(reply["copied"]),
            dirty=int(reply["dirty"]),
            dirty_by_tier={str(k): int(v) for k, v in reply["dirty_by_tier"].items()},
            reason=str(reply["reason"]),
            remote_sent=int(reply.get("remote_sent", 0)),
            remote_missed=int(reply.get("remote_missed", 0)),
            remote_missed_by_level={
                str(level): {str(k): int(v) for k, v in causes.items()}
                for level, causes in by_level.items()
            },
            remote_reason=str(reply.get("remote_reason", "")),
        )

    async def describe(self, keys: Sequence[bytes], blocks: Sequence[Mapping[str, Any]]) -> int:
        """Say what each block of ``keys`` is in the engine's terms (docs/events.md), for
        the KV events routers read; returns how many descriptions the daemon kept (0 when
        its ``kv_events:`` section does not publish this tenant)."""
        packed = [msgpack.packb(block, use_bin_type=True) for block in blocks]
        return int((await self.request("describe", keys=list(keys), blocks=packed))["kept"])

    async def blocks_held(
        self, requests: Sequence[Sequence[int | bytes]], *, tenant: str | None = None
    ) -> list[list[str]]:
        """For each list of engine block hashes: the media of the leading blocks the
        node holds (as many as it holds, up to the first it does not)."""
        flat = [h for request in requests for h in request]
        lengths = [len(request) for request in requests]
        reply = await self.request(
            "blocks_held", hashes=flat, lengths=lengths, **_present(tenant=tenant)
        )
        return [list(m) for m in reply["media"]]

    async def sizes(
        self, *, tenant: str | None = None, give_back: int | None = None
    ) -> dict[str, dict[str, Any]]:
        """Each tenant's block sizes (an operator's: every tenant, or ``tenant``); with
        ``give_back``, that size of ``tenant`` is given back first (docs/config.md,
        ``block_sizes``)."""
        reply = await self.request("sizes", **_present(tenant=tenant, give_back=give_back))
        return dict(reply["tenants"])

    async def clear(self, tier: str | None = None) -> int:
        fields = {} if tier is None else {"tier": tier}
        return int((await self.request("clear", **fields))["removed"])

    async def namespaces(self, tenant: str | None = None) -> dict[str, list[dict[str, Any]]]:
        """Each tenant's namespaces (an operator's: every tenant, or ``tenant``)."""
        reply = await self.request("namespaces", **_present(tenant=tenant))
        return dict(reply["tenants"])

    async def inspect(
        self,
        key: bytes,
        *,
        namespace: str | None = None,
        namespace_id: str | None = None,
        tenant: str | None = None,
    ) -> dict[str, Any]:
        """Where ``key`` lives: in this connection's namespace, or the one named."""
        where = _present(namespace=namespace, namespace_id=namespace_id, tenant=tenant)
        reply = await self.request("inspect", key=key, **where)
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    async def delete(
        self,
        keys: Sequence[bytes] | None = None,
        *,
        prefix: bytes | None = None,
        everything: bool = False,
        namespace: str | None = None,
        namespace_id: str | None = None,
        tenant: str | None = None,
    ) -> dict[str, Any]:
        """Delete ``keys``, the keys starting with ``prefix``, or (``everything``) a whole
        namespace (this connection's, or the one named); ``removed`` and ``busy`` (kept:
        in use, ask again) come back."""
        fields = _present(
            keys=list(keys) if keys is not None else None,
            prefix=prefix,
            all=True if everything else None,
            namespace=namespace,
            namespace_id=namespace_id,
            tenant=tenant,
        )
        reply = await self.request("delete", **fields)
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    async def reload(self) -> dict[str, Any]:
        """Read the daemon's config again: what was ``applied``, what is ``restart_needed``."""
        reply = await self.request("reload")
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}


def _present(**fields: Any) -> dict[str, Any]:
    """The fields that have a value (a request leaves the others out)."""
    return {name: value for name, value in fields.items() if value is not None}
