"""The operator's requests: ``clear``, ``stop``, ``flush``, ``config``, ``metrics``,
``reload``, ``trace`` and ``sizes``.

Each needs an operator grant (decided by the server from the peer's credentials); others
get ``not_allowed``. ``clear``, ``stop`` and ``reload`` act for every client, so they also need a
connection without a namespace. ``clear`` and ``flush`` act on every tenant, or on the
one their ``tenant`` field names. An :class:`OperatorRequests` knows its session only
through :class:`Caller`.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from tierd.chain import FlushResult
from tierd.control.protocol import ErrorCode, bool_field, int_field, opt_str_field
from tierd.control.state.context import ServerContext
from tierd.control.state.tenant_table import Grant, Tenant
from tierd.errors import ConfigError, ProtocolError

__all__ = ["Caller", "OperatorRequests"]

Reply = dict[str, Any]


class Caller(Protocol):
    """Who sends the requests: what the operator checks ask of the session."""

    @property
    def grant(self) -> Grant:
        """The connection's rights, from its peer's credentials."""
        ...

    @property
    def namespace(self) -> str | None:
        """The namespace named in hello (None: none was)."""
        ...


class OperatorRequests:
    """The operator requests of one session: each checks the caller's grant first."""

    def __init__(self, ctx: ServerContext, caller: Caller) -> None:
        self.ctx = ctx
        self.caller = caller

    def _require_operator(self, op: str, *, without_namespace: bool = False) -> None:
        grant = self.caller.grant
        if not grant.operator:
            raise ProtocolError(
                f"{op} needs an operator: tenant {grant.label} may not send it",
                code=ErrorCode.NOT_ALLOWED,
            )
        if without_namespace and self.caller.namespace is not None:
            raise ProtocolError(
                f"{op} acts for every client: only a connection without a namespace (an"
                " operator's) may send it",
                code=ErrorCode.NOT_ALLOWED,
            )

    def _tenants_asked(self, msg: dict[str, Any]) -> list[Tenant]:
        """Every tenant, or the one the ``tenant`` field names, at each block size."""
        name = opt_str_field(msg, "tenant")
        if name is None:
            return list(self.ctx.tenants.every())
        tenant = self.ctx.tenants.named(name)
        if tenant is None:
            names = ", ".join(t.name for t in self.ctx.tenants.tenants)
            raise ProtocolError(f"no tenant named {name!r} ({names})", code=ErrorCode.BAD_REQUEST)
        return tenant.each_size()

    def config(self, msg: dict[str, Any]) -> Reply:
        self._require_operator("config")
        return {"config": self.ctx.config}

    def metrics(self, msg: dict[str, Any]) -> Reply:
        self._require_operator("metrics")
        return {"text": self.ctx.metrics()}

    async def clear(self, msg: dict[str, Any]) -> Reply:
        """Drop every idle block (of one tier), a piece of each index a turn."""
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
        removed = 0
        for tenant in tenants:
            removed += await tenant.chain.clear_in_pieces(index)
        return {"removed": removed}

    def stop(self, msg: dict[str, Any]) -> Reply:
        self._require_operator("stop", without_namespace=True)
        if self.ctx.request_stop is None:
            raise ProtocolError("this server cannot be stopped", code=ErrorCode.NOT_ALLOWED)
        self.ctx.request_stop()  # the daemon drains on a later turn: this reply goes first
        return {"pid": os.getpid()}

    async def reload(self, msg: dict[str, Any]) -> Reply:
        """Read the config again and apply what can change live (all or nothing). The
        file is read off the loop: other requests are answered meanwhile."""
        self._require_operator("reload", without_namespace=True)
        if self.ctx.reload is None:
            raise ProtocolError("this server has no config to reload", code=ErrorCode.NOT_ALLOWED)
        try:
            return await self.ctx.reload()
        except ConfigError as exc:
            raise ProtocolError(f"nothing was changed: {exc}", code=ErrorCode.BAD_CONFIG) from exc

    def trace(self, msg: dict[str, Any]) -> Reply:
        """Recording of live traffic: its state; ``enabled`` (bool) turns it on or off."""
        self._require_operator("trace")
        recorder = self.ctx.recorder
        if recorder is None and "enabled" not in msg:
            return {"trace": {"configured": False, "enabled": False}}
        if recorder is None:
            raise ProtocolError(
                "recording is not set up: add a 'trace:' section naming a 'directory' to "
                "the daemon's config file and restart the daemon (docs/sizing.md)",
                code=ErrorCode.NOT_ALLOWED,
            )
        if "enabled" in msg:
            on = bool_field(msg, "enabled", False)
            try:
                recorder.set_enabled(on)
            except ConfigError as exc:  # a directory another user could read or redirect
                raise ProtocolError(
                    f"cannot record to {recorder.settings.directory}: {exc}",
                    code=ErrorCode.BAD_CONFIG,
                ) from exc
            except OSError as exc:
                raise ProtocolError(
                    f"cannot record to {recorder.settings.directory}: {exc.strerror or exc}",
                    code=ErrorCode.IO_ERROR,
                ) from exc
        return {"trace": {"configured": True, **recorder.state()}}

    async def flush(self, msg: dict[str, Any]) -> Reply:
        self._require_operator("flush")
        done = FlushResult(0)
        for tenant in self._tenants_asked(msg):
            done = done.plus(await tenant.chain.flush())
        return {
            "copied": done.copied,
            "dirty": done.left_dirty,
            "dirty_by_tier": done.dirty,
            "reason": done.reason,
            "remote_sent": done.remote_sent,
            "remote_missed": done.not_landed,
            "remote_missed_by_level": done.remote_missed,
            "remote_reason": done.remote_reason,
        }

    async def sizes(self, msg: dict[str, Any]) -> Reply:
        """Each tenant's block sizes (or the ``tenant`` field's; a member's: its own):
        whether configured, its connections, how long unused. ``give_back`` (bytes, with
        ``tenant`` when there are several; an operator's): give that size back first (its
        blocks dropped, its share and slab freed)."""
        grant = self.caller.grant
        if not grant.operator and grant.tenant is not None and "give_back" not in msg:
            return {"tenants": {grant.tenant.name: grant.tenant.size_report()}}  # its own
        self._require_operator("sizes" if "give_back" not in msg else "sizes give_back")
        name = opt_str_field(msg, "tenant")
        tenants = self.ctx.tenants.tenants
        if name is not None:
            tenants = [t for t in tenants if t.name == name]
            if not tenants:
                names = ", ".join(t.name for t in self.ctx.tenants.tenants)
                raise ProtocolError(
                    f"no tenant named {name!r} ({names})", code=ErrorCode.BAD_REQUEST
                )
        if "give_back" in msg:
            size = int_field(msg, "give_back")
            if len(tenants) > 1:
                raise ProtocolError(
                    "give_back needs the tenant whose size it is (the tenant field)",
                    code=ErrorCode.BAD_REQUEST,
                )
            sizes = tenants[0].sizes
            if sizes is None:
                raise ProtocolError(
                    "this daemon serves one block size (block_sizes: 1): nothing to give back",
                    code=ErrorCode.BAD_REQUEST,
                )
            try:
                await sizes.give_back(size)
            except LookupError as exc:
                raise ProtocolError(str(exc), code=ErrorCode.NOT_ALLOWED) from exc
        return {"tenants": {t.name: t.size_report() for t in tenants}}
