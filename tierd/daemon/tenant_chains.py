"""The daemon's tenants (:mod:`tierd.tenancy`): their chains, who is which, and how much
each may hold in leases.

One chain is opened per tenant, each with its quota of every tier, its own memfd pool
(handed to its clients as a descriptor: nothing of it is in /dev/shm, so there is nothing
to reap after a crash and nothing another daemon, in another PID namespace or not, could
remove) and its own disk slab under ``<directory>/<tenant>``. Without a ``tenants:``
section there is one tenant, ``default``, with whole tiers and the disk directories
themselves.

With ``block_sizes: N`` (N > 1) each tenant serves up to N block sizes, each in an equal
share of its tiers (:func:`tierd.config.size_class_chain`): the configured
``block_bytes`` opens at start; another size opens when a hello first names it, and is
recorded in ``block_sizes.json`` beside the tenant's namespace names, so the next start
opens it again with its disk slab (``<directory>/blocks-<bytes>``) and its blocks.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from contextlib import AsyncExitStack
from pathlib import Path

import structlog

from tierd.chain import TierChain
from tierd.config import ChainConfig, DaemonConfig, TierKind, size_class_chain
from tierd.control.figures.namespaces import NAMES_FILE, NamespaceBook
from tierd.control.protocol import NAMESPACE_ID_BYTES
from tierd.control.state.tenant_table import Grant, PoolInfo, SizeClasses, Tenant, TenantTable
from tierd.errors import ConfigError, TierdError
from tierd.library import open_chain
from tierd.stores.cpu import CpuStore, StartProgress
from tierd.stores.disk.slab import SLAB_FILE
from tierd.tenancy import TenantConfig
from tierd.units import share_parts

__all__ = [
    "SIZES_FILE",
    "apply_tenant_rules",
    "grants_for",
    "lease_bound",
    "names_file",
    "open_tenants",
    "warn_of_tiers_above_the_entry",
    "warn_of_untenanted_slabs",
]

log = structlog.get_logger("tierd")

SIZES_FILE = "block_sizes.json"  # a tenant's block sizes besides the configured one


async def open_tenants(
    cfg: DaemonConfig,
    stack: AsyncExitStack,
    chains: dict[str, TierChain],
    progress: StartProgress | None = None,
) -> TenantTable:
    """Open one chain per tenant (see :mod:`tierd.tenancy`) and say who is which. Each
    chain is entered into ``stack`` and put in ``chains`` (by tenant) as it opens;
    ``progress`` hears how the CPU pools' allocation and pinning go."""
    table = TenantTable()
    warn_of_untenanted_slabs(cfg)
    warn_of_tiers_above_the_entry(cfg)
    for spec, chain_cfg in cfg.tenant_chains():
        own_cfg = chain_cfg
        if cfg.block_sizes > 1:
            own_cfg = size_class_chain(chain_cfg, cfg.block_bytes, cfg.block_sizes)
        chain = await _open_chain(cfg, spec, own_cfg, stack, progress)
        chains[spec.name] = chain
        tenant = _tenant(cfg, spec, chain)
        tenant.book = NamespaceBook(
            names_file(chain_cfg), max_names=cfg.limits.namespaces_per_tenant
        )
        stack.push_async_callback(tenant.book.close)  # before the chain closes: names kept
        chain.prefix_census(NAMESPACE_ID_BYTES)  # blocks per namespace, counted from now on
        table.tenants.append(tenant)
        if cfg.block_sizes > 1:
            await _size_classes(cfg, spec, chain_cfg, tenant, stack, chains)
        elif unserved := _recorded_sizes(sizes_file(chain_cfg)):
            log.warning(
                "block sizes served before are not opened (block_sizes: 1); their slabs"
                " stay on disk, in blocks-<bytes> beside this one, until removed",
                tenant=spec.name,
                block_sizes=unserved,
            )
    table.grants = grants_for(cfg, table)
    if cfg.tenants:
        log.info(
            "tenants",
            tenants={t.name: [lv.tier.num_blocks for lv in t.chain.levels] for t in table.tenants},
        )
    return table


async def _open_chain(
    cfg: DaemonConfig,
    spec: TenantConfig,
    chain_cfg: ChainConfig,
    stack: AsyncExitStack,
    progress: StartProgress | None = None,
) -> TierChain:
    """Open one of a tenant's chains into ``stack``; an error names the tenant."""
    try:
        # Every line the chain logs while it opens (``tier opened``) names the tenant.
        with structlog.contextvars.bound_contextvars(tenant=spec.name):
            return await stack.enter_async_context(open_chain(chain_cfg, progress=progress))
    except TierdError as exc:
        if cfg.tenants:  # name the tenant: each has tiers of the same names
            exc.args = (f"tenant {spec.name!r}: {exc}", *exc.args[1:])
        raise


async def _size_classes(
    cfg: DaemonConfig,
    spec: TenantConfig,
    chain_cfg: ChainConfig,
    tenant: Tenant,
    stack: AsyncExitStack,
    chains: dict[str, TierChain],
) -> None:
    """Give ``tenant`` its size classes, and open again the sizes it served before."""
    record = sizes_file(chain_cfg)
    recording = asyncio.Lock()
    closers: dict[int, AsyncExitStack] = {}  # each size's chain, closed on its own

    async def rerecord(sizes: SizeClasses, opened: int | None = None) -> None:
        """Write the sizes open now (and ``opened``) for the next start, one write at a time."""
        if record is None:
            return
        async with recording:
            learned = [size for size in sizes.by_size if size != cfg.block_bytes]
            if opened is not None and opened not in learned:
                learned.append(opened)
            try:
                await asyncio.to_thread(_record_sizes, record, learned)
            except OSError as exc:  # served now all the same; the next start learns it again
                log.warning(
                    "cannot record the block sizes served: a restart opens them only when"
                    " a hello names them again",
                    path=str(record),
                    error=exc.strerror or str(exc),
                )

    async def open_size(block_bytes: int) -> Tenant:
        sized_cfg = size_class_chain(chain_cfg, block_bytes, cfg.block_sizes)
        for tier in sized_cfg.tiers:
            for directory in tier.directories:
                directory.mkdir(mode=0o700, exist_ok=True)
        own = AsyncExitStack()
        try:
            chain = await _open_chain(cfg, spec, sized_cfg, own)
        except (TierdError, OSError) as exc:
            log.error(
                "a block size cannot be opened",
                tenant=spec.name,
                block_bytes=block_bytes,
                error=str(exc),
            )
            raise
        closers[block_bytes] = own
        stack.push_async_callback(own.aclose)  # at the stop, unless given back before
        chains[f"{spec.name}@{block_bytes}"] = chain
        sized = _tenant(cfg, spec, chain)
        sized.book, sized.sizes = tenant.book, tenant.sizes
        chain.prefix_census(NAMESPACE_ID_BYTES)
        if sizes is not None:
            await rerecord(sizes, block_bytes)
        log.info(
            "block size opened",
            tenant=spec.name,
            block_bytes=block_bytes,
            tiers={lv.tier.name: lv.tier.num_blocks for lv in chain.levels},
        )
        return sized

    async def close_size(block_bytes: int, sized: Tenant) -> None:
        """Give ``block_bytes`` back: drop its blocks (the chain's events say so), close
        its chain (its pool's memory goes back), remove its slab and its record."""
        removed = await sized.chain.clear_in_pieces(None)
        await closers.pop(block_bytes).aclose()
        chains.pop(f"{spec.name}@{block_bytes}", None)
        sized_cfg = size_class_chain(chain_cfg, block_bytes, cfg.block_sizes)
        slabs = [
            directory
            for tier in sized_cfg.tiers
            for directory in tier.directories
            if directory.name == f"blocks-{block_bytes}"  # a size's own: never the tenant's
        ]
        for directory in slabs:
            try:
                await asyncio.to_thread(shutil.rmtree, directory)
            except OSError as exc:
                log.warning(
                    "a given-back size's slab cannot be removed",
                    path=str(directory),
                    error=exc.strerror or str(exc),
                )
        if sizes is not None:
            await rerecord(sizes)
        log.info(
            "block size given back",
            tenant=spec.name,
            block_bytes=block_bytes,
            blocks_dropped=removed,
        )

    sizes = tenant.sizes = SizeClasses(
        cfg.block_sizes,
        {cfg.block_bytes: tenant},
        open_size,
        cfg.limits.min_block_bytes,
        close_size,
        cfg.limits.block_size_idle_s,
    )
    for block_bytes in _recorded_sizes(record):
        problem = sizes.refusal(block_bytes)
        if problem is not None:
            log.warning(
                "a block size served before is not opened",
                tenant=spec.name,
                block_bytes=block_bytes,
                reason=problem,
            )
            continue
        try:
            await sizes.open(block_bytes)
        except ConfigError as exc:  # its share holds no block of it any more
            log.warning(
                "a block size served before is not opened",
                tenant=spec.name,
                block_bytes=block_bytes,
                reason=str(exc),
            )


def sizes_file(chain_cfg: ChainConfig) -> Path | None:
    """Where a tenant's block sizes are kept: beside its namespace names."""
    names = names_file(chain_cfg)
    return None if names is None else names.parent / SIZES_FILE


def _recorded_sizes(path: Path | None) -> list[int]:
    """The block sizes a tenant served before (none when the file is missing or bad)."""
    if path is None:
        return []
    try:
        sizes = json.loads(path.read_text())["block_sizes"]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("the block sizes served before cannot be read", path=str(path), error=str(exc))
        return []
    if not isinstance(sizes, list) or not all(type(s) is int and s > 0 for s in sizes):
        log.warning("the block sizes served before cannot be read", path=str(path))
        return []
    return list(dict.fromkeys(sizes))


def _record_sizes(path: Path, sizes: list[int]) -> None:
    """Write ``sizes`` to ``path`` whole (a crash leaves the old file or the new one)."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps({"block_sizes": sizes}) + "\n")
    part.chmod(0o600)
    os.replace(part, path)


def names_file(chain_cfg: ChainConfig) -> Path | None:
    """Where a tenant's namespace names are kept: beside its first disk tier's slab (only
    the disk tier outlives the daemon: without one there is nothing to name after a
    restart, and nothing is written)."""
    for tier in chain_cfg.tiers:
        if tier.kind == TierKind.DISK and tier.directories:
            return tier.directories[0] / NAMES_FILE
    return None


def apply_tenant_rules(cfg: DaemonConfig, table: TenantTable) -> None:
    """What a reload changes of the running tenants (at every block size): their
    namespace patterns, lease bounds, and who is which (for connections from then on)."""
    for tenant, (spec, _) in zip(table.tenants, cfg.tenant_chains(), strict=True):
        tenant.book.max_names = cfg.limits.namespaces_per_tenant
        if tenant.sizes is not None:
            tenant.sizes.smallest = cfg.limits.min_block_bytes
            tenant.sizes.idle_s = cfg.limits.block_size_idle_s
        for sized in tenant.each_size():
            entry = sized.chain.levels[sized.chain.entry].store.num_blocks
            sized.namespaces = tuple(spec.namespaces)
            sized.max_held = lease_bound(cfg.limits.lease_blocks_per_tenant, entry)
            sized.max_held_per_connection = lease_bound(
                cfg.limits.lease_blocks_per_connection, entry
            )
    table.grants = grants_for(cfg, table)


def _tenant(cfg: DaemonConfig, spec: TenantConfig, chain: TierChain) -> Tenant:
    """Tenant ``spec`` with its open ``chain``: the pool its clients map (when the entry
    tier is a CPU tier in a memfd) and its lease bounds (shares of the entry tier)."""
    entry = chain.levels[chain.entry].store
    pool = None
    if isinstance(entry, CpuStore) and entry.fd is not None:
        pool = PoolInfo(entry.fd, entry.name, entry.size, entry.stride, entry.num_blocks)
    blocks = entry.num_blocks
    return Tenant(
        spec.name,
        chain,
        pool,
        namespaces=tuple(spec.namespaces),
        max_held=lease_bound(cfg.limits.lease_blocks_per_tenant, blocks),
        max_held_per_connection=lease_bound(cfg.limits.lease_blocks_per_connection, blocks),
    )


def warn_of_untenanted_slabs(cfg: DaemonConfig) -> None:
    """With tenants, each tenant's slab is in ``<directory>/<tenant>/``: a slab left in a
    directory itself by a daemon without tenants serves nobody, and still takes its space."""
    if not cfg.tenants:
        return
    for tier in cfg.tiers:
        for directory in tier.directories:
            left = directory / SLAB_FILE
            if left.exists():
                log.warning(
                    "a slab of a daemon without tenants is left here: no tenant is served"
                    " its blocks; remove it to free its space",
                    tier=tier.name,
                    path=str(left),
                    bytes=left.stat().st_size,
                )


def warn_of_tiers_above_the_entry(cfg: DaemonConfig) -> None:
    """Socket clients store at the entry tier and load into it: a tier above it (a GPU
    tier listed first, say) is never filled by them, and holds its memory for nothing."""
    for tier in cfg.tiers[: cfg.entry_index]:
        log.warning(
            "a tier above the entry tier is never filled by socket clients (docs/gpu.md)",
            tier=tier.name,
            entry=cfg.tiers[cfg.entry_index].name,
        )


def grants_for(cfg: DaemonConfig, table: TenantTable) -> list[Grant]:
    """Who is which tenant. Without ``tenants:``, the daemon's own user is the default
    tenant's operator and ``socket.allow_uids``/``allow_gids`` are its members; with it,
    the daemon's own user, when no tenant lists it, may run operator commands only."""
    me = os.getuid()
    if not cfg.tenants:
        tenant = table.tenants[0]
        return [
            Grant(tenant, True, frozenset({me})),
            Grant(
                tenant, False, frozenset(cfg.socket.allow_uids), frozenset(cfg.socket.allow_gids)
            ),
        ]
    grants = [
        Grant(tenant, spec.operator, frozenset(spec.uids), frozenset(spec.gids))
        for tenant, spec in zip(table.tenants, cfg.tenants, strict=True)
    ]
    if not any(me in spec.uids for spec in cfg.tenants):
        grants.append(Grant(None, True, frozenset({me})))
    return grants


def lease_bound(value: int | str, entry_blocks: int) -> int:
    """A lease bound in blocks: a count, or a share of the tenant's entry tier."""
    amount, is_share = share_parts(value)
    return max(1, int(amount * entry_blocks)) if is_share else int(amount)
