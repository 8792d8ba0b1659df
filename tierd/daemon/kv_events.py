"""The daemon's KV events (the ``kv_events:`` section, docs/events.md), opened and closed.

:func:`open_kv_events` binds the publisher (a bind that fails stops the start, naming the
address), gives each published tenant its book of block descriptions (read back from the
file beside its first disk tier's slab, when it has one) and starts the feed. Everything
is closed by ``stack``, the feed before the publisher, both before the chains.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

from tierd.config import DaemonConfig
from tierd.control.tenants import TenantTable
from tierd.daemon.tenants import names_file
from tierd.kvevents.book import DescriptorBook
from tierd.kvevents.book_file import FILE_NAME, BookFile, read_book
from tierd.kvevents.feed import EventFeed, FeedSettings, KvTenant
from tierd.kvevents.publisher import Publisher, PublisherSettings

__all__ = ["open_kv_events"]


async def open_kv_events(
    cfg: DaemonConfig, table: TenantTable, stack: AsyncExitStack
) -> EventFeed | None:
    """The running feed of ``cfg.kv_events`` (None: the section is off)."""
    kv = cfg.kv_events
    if not kv.enabled:
        return None
    publisher = Publisher(
        PublisherSettings(
            endpoint=kv.endpoint,
            replay_endpoint=kv.replay_endpoint,
            topic=kv.topic,
            buffer_batches=kv.buffer_batches,
            queue_batches=kv.queue_batches,
            hwm=kv.hwm,
            dp_rank=kv.data_parallel_rank,
        )
    )
    publisher.start()
    stack.callback(publisher.close)
    tenants = []
    for tenant, (_, chain_cfg) in zip(table.tenants, cfg.tenant_chains(), strict=True):
        if kv.publishes(tenant.name):
            book = DescriptorBook(kv.descriptor_bytes)
            published = KvTenant(tenant.name, tenant.chain, book)
            directory = names_file(chain_cfg)
            if directory is not None:
                await _keep(published, directory.parent / FILE_NAME)
            tenants.append(published)
    settings = FeedSettings(
        media=dict(kv.media),
        locality=kv.locality,
        ownership=kv.ownership,
        batch_s=kv.batch_s,
        max_batch_events=kv.max_batch_events,
    )
    feed = EventFeed(publisher, tenants, settings)
    stack.push_async_callback(feed.close)
    feed.start()
    return feed


async def _keep(tenant: KvTenant, where: Path) -> None:
    """Read the tenant's descriptions back and keep its book in ``where`` from now on."""
    book = tenant.book
    restored = await asyncio.to_thread(read_book, where)
    book.restore(restored)
    tenant.restored = list(restored)
    file = BookFile(where, book.row_parts)
    await asyncio.to_thread(file.start)
    book.on_change = lambda key, entry: file.changed(key, entry, book.bytes_used)
    tenant.file = file
