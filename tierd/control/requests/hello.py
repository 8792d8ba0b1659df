"""The daemon's side of ``hello``: what it checks, and what it answers.

``hello`` must speak this daemon's protocol version and, when it names one, a block
size the tenant serves: one of its size classes (``block_sizes``), a new one opened
first when the tenant has room for it (:func:`size_to_open`; the session awaits it), or
the one size of a tenant without classes. The namespace it names must be one of the
tenant's patterns (a user of no tenant may name none: it may run operator commands and
keeps no blocks), and a name the tenant has not used before only while its book has room for it
(``limits.namespaces_per_tenant``); its 8-byte id then prefixes every key of the
connection. The reply describes the daemon and the tenant's
tiers and pool; a ``pool_fd: true`` hello gets the pool's descriptor passed beside it
(under :data:`~tierd.control.protocol.PASS_FDS`, which the connection sends with
SCM_RIGHTS). The session decides when hello may come (first, once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tierd.control.protocol import PASS_FDS, PROTOCOL_VERSION, ErrorCode, int_field, opt_str_field
from tierd.control.state.context import ServerContext
from tierd.control.state.tenant_table import Tenant
from tierd.errors import ProtocolError, TierdError

__all__ = ["Greeted", "answer_hello", "open_size", "size_to_open"]


@dataclass(frozen=True, slots=True)
class Greeted:
    """An accepted hello: the connection's namespace (None: none named), the prefix of
    its keys, and the reply to send."""

    namespace: str | None
    prefix: bytes
    reply: dict[str, Any]
    tenant: Tenant | None  # the tenant at the connection's block size


# An inline put carries one block and its frame's header in one frame.
_FRAME_ROOM = 64 << 10


def size_to_open(ctx: ServerContext, tenant: Tenant | None, msg: dict[str, Any]) -> int | None:
    """The block size ``msg`` names that ``tenant`` may serve but has not opened yet."""
    wanted = msg.get("block_bytes")
    if tenant is None or tenant.sizes is None or type(wanted) is not int:
        return None
    if wanted in tenant.sizes.by_size or not 0 < wanted <= _largest(ctx):
        return None
    return wanted if tenant.sizes.refusal(wanted) is None else None


async def open_size(tenant: Tenant | None, block_bytes: int) -> None:
    """Open ``tenant``'s chain at ``block_bytes`` (a size :func:`size_to_open` named);
    refused with a :class:`ProtocolError` saying why."""
    if tenant is None or tenant.sizes is None:
        raise ProtocolError(f"block size {block_bytes} is not served", code=ErrorCode.BAD_REQUEST)
    try:
        await tenant.sizes.open(block_bytes)
    except LookupError as exc:  # its room was taken meanwhile
        raise ProtocolError(str(exc), code=ErrorCode.BLOCK_SIZE_MISMATCH) from exc
    except (TierdError, OSError) as exc:
        raise ProtocolError(
            f"block size {block_bytes} cannot be served: {exc}",
            code=ErrorCode.BLOCK_SIZE_MISMATCH,
        ) from exc


def _largest(ctx: ServerContext) -> int:
    return ctx.limits.max_frame_bytes - _FRAME_ROOM


def answer_hello(ctx: ServerContext, tenant: Tenant | None, msg: dict[str, Any]) -> Greeted:
    """Check ``msg``, a hello from a peer of ``tenant``; refused with a :class:`ProtocolError`."""
    version = int_field(msg, "version")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version} is not supported (this daemon speaks {PROTOCOL_VERSION})",
            code=ErrorCode.VERSION_MISMATCH,
        )
    if msg.get("block_bytes") is not None:
        tenant = _at_size(ctx, tenant, int_field(msg, "block_bytes"))
    namespace = opt_str_field(msg, "namespace", max_len=1024)
    prefix = b"" if namespace is None else _namespace_prefix(ctx, tenant, namespace)
    reply = ctx.hello_fields(prefix, tenant)
    pool = tenant.pool if tenant is not None else None
    if msg.get("pool_fd") is True and pool is not None:
        reply[PASS_FDS] = [pool.fd]  # the connection sends it beside this reply
    return Greeted(namespace, prefix, reply, tenant)


def _at_size(ctx: ServerContext, tenant: Tenant | None, block_bytes: int) -> Tenant | None:
    """``tenant`` at ``block_bytes``; refused when it does not serve that size."""
    served = ctx.default_block_bytes if tenant is None else tenant.block_bytes
    if block_bytes == served:
        return tenant
    sizes = None if tenant is None else tenant.sizes
    if sizes is None:
        raise ProtocolError(
            f"block size {block_bytes} does not match the daemon's {served}; a daemon"
            " serves several sizes with block_sizes: 2 (or more) in its config",
            code=ErrorCode.BLOCK_SIZE_MISMATCH,
        )
    if not 0 < block_bytes <= _largest(ctx):
        raise ProtocolError(
            f"block size {block_bytes} is not served: a block must be 1 to {_largest(ctx)}"
            " bytes (limits.max_frame_bytes less 64KiB)",
            code=ErrorCode.BLOCK_SIZE_MISMATCH,
        )
    sized = sizes.by_size.get(block_bytes)
    if sized is None:
        problem = sizes.refusal(block_bytes) or f"block size {block_bytes} is not open"
        raise ProtocolError(problem, code=ErrorCode.BLOCK_SIZE_MISMATCH)
    return sized


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
