"""The daemon's side of ``hello``: what it checks, and what it answers.

``hello`` must speak this daemon's protocol version and, when it names one, its block
size. The namespace it names must be one of the tenant's patterns (a user of no tenant
may name none: it may run operator commands and keeps no blocks), and a name the
tenant has not used before only while its book has room for it
(``limits.namespaces_per_tenant``); its 8-byte id then prefixes every key of the
connection. The reply describes the daemon and the tenant's
tiers and pool; a ``pool_fd: true`` hello gets the pool's descriptor passed beside it
(under :data:`~tierd.control.protocol.PASS_FDS`, which the connection sends with
SCM_RIGHTS). The session decides when hello may come (first, once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tierd.control.context import ServerContext
from tierd.control.protocol import PASS_FDS, PROTOCOL_VERSION, ErrorCode, int_field, opt_str_field
from tierd.control.tenants import Tenant
from tierd.errors import ProtocolError

__all__ = ["Greeted", "answer_hello"]


@dataclass(frozen=True, slots=True)
class Greeted:
    """An accepted hello: the connection's namespace (None: none named), the prefix of
    its keys, and the reply to send."""

    namespace: str | None
    prefix: bytes
    reply: dict[str, Any]


def answer_hello(ctx: ServerContext, tenant: Tenant | None, msg: dict[str, Any]) -> Greeted:
    """Check ``msg``, a hello from a peer of ``tenant``; refused with a :class:`ProtocolError`."""
    version = int_field(msg, "version")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version} is not supported (this daemon speaks {PROTOCOL_VERSION})",
            code=ErrorCode.VERSION_MISMATCH,
        )
    block_bytes = msg.get("block_bytes")
    if block_bytes is not None and int_field(msg, "block_bytes") != ctx.block_bytes:
        raise ProtocolError(
            f"block size {block_bytes} does not match the daemon's {ctx.block_bytes}",
            code=ErrorCode.BLOCK_SIZE_MISMATCH,
        )
    namespace = opt_str_field(msg, "namespace", max_len=1024)
    prefix = b"" if namespace is None else _namespace_prefix(ctx, tenant, namespace)
    reply = ctx.hello_fields(prefix, tenant)
    pool = tenant.pool if tenant is not None else None
    if msg.get("pool_fd") is True and pool is not None:
        reply[PASS_FDS] = [pool.fd]  # the connection sends it beside this reply
    return Greeted(namespace, prefix, reply)


def _namespace_prefix(ctx: ServerContext, tenant: Tenant | None, namespace: str) -> bytes:
    """The id of ``namespace``, if ``tenant`` may use it."""
    if tenant is None:
        raise ProtocolError(
            "this user belongs to no tenant: it may run operator commands, without"
            " a namespace, and keeps no blocks",
            code=ErrorCode.NOT_ALLOWED,
        )
    problem = ctx.check_namespace(namespace) or tenant.namespace_problem(namespace)
    if problem is not None:
        raise ProtocolError(problem, code=ErrorCode.BAD_NAMESPACE)
    namespace_id = ctx.namespace_id(namespace)
    refusal = tenant.book.refusal(namespace, namespace_id)
    if refusal is not None:  # each new name stays in the book (and its file) for good
        raise ProtocolError(refusal, code=ErrorCode.TOO_MANY_NAMESPACES)
    return namespace_id
