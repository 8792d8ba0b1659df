"""The daemon's KV events (the ``kv_events:`` section, docs/events.md), opened and closed.

:func:`open_kv_events` binds each published tenant's publisher (a bind that fails stops the
start, naming the address), by default on ipc sockets in a directory of the tenant's own
(``events/<tenant>/pub`` and ``replay`` beside the control socket, mode 0700: the daemon's
user only; 0750 for the tenant's ``readers`` group), gives each its book of block
descriptions (read back from the file beside its first disk tier's slab, when it has one)
and starts the feed. Everything is closed by ``stack``, the feed before the publisher, both
before the chains.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

from tierd.config import DaemonConfig
from tierd.control.socketfile import check_directory
from tierd.control.state.tenant_table import TenantTable
from tierd.daemon.tenant_chains import names_file
from tierd.errors import ConfigError
from tierd.kvevents.book import DescriptorBook
from tierd.kvevents.book_file import FILE_NAME, BookFile, read_book
from tierd.kvevents.feed import EventFeed, FeedSettings, KvTenant, Stream
from tierd.kvevents.publisher import Publisher, PublisherSettings

__all__ = ["events_directory", "open_kv_events"]


async def open_kv_events(
    cfg: DaemonConfig, table: TenantTable, stack: AsyncExitStack
) -> EventFeed | None:
    """The running feed of ``cfg.kv_events`` (None: the section is off)."""
    kv = cfg.kv_events
    if not kv.enabled:
        return None
    tenants = []
    loop = asyncio.get_running_loop()
    first_seq = time.time_ns() // 1000  # past every batch of an earlier incarnation
    for tenant, (_, chain_cfg) in zip(table.tenants, cfg.tenant_chains(), strict=True):
        if kv.publishes(tenant.name):
            subscribed = asyncio.Event()
            publisher = Publisher(
                _stream_settings(cfg, tenant.name, first_seq),
                on_subscribed=_waking(loop, subscribed),
            )
            publisher.start()
            stack.callback(publisher.close)
            book = DescriptorBook(kv.descriptor_bytes)
            stream = Stream(publisher, subscribed)
            published = KvTenant(tenant.name, tenant.chain, book, stream)
            directory = names_file(chain_cfg)
            if directory is not None:
                await _keep(published, directory.parent / FILE_NAME)
            tenants.append(published)
    settings = FeedSettings(
        media=dict(kv.media),
        locality=kv.locality,
        batch_s=kv.batch_s,
        max_batch_events=kv.max_batch_events,
    )
    feed = EventFeed(tenants, settings)
    stack.push_async_callback(feed.close)
    feed.start()
    return feed


def _waking(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> Callable[[], None]:
    """A call that sets ``event`` on ``loop`` from any thread."""

    def wake() -> None:
        loop.call_soon_threadsafe(event.set)

    return wake


def events_directory(cfg: DaemonConfig) -> Path:
    """Where each tenant's own event sockets are (``<directory>/<tenant>/``)."""
    return cfg.kv_events.directory or cfg.socket.path.parent / "events"


def _stream_settings(cfg: DaemonConfig, tenant: str, first_seq: int) -> PublisherSettings:
    """Where ``tenant``'s stream goes: the endpoints written out, or its own directory
    (mode 0700, or 0750 for its readers' group), made here."""
    kv = cfg.kv_events
    endpoint, replay, group = kv.endpoint, kv.replay_endpoint, None
    if endpoint is None:
        group = kv.reader_gid(tenant)
        home = events_directory(cfg)
        try:
            _private_directory(home, 0o711)  # others may pass, not list the tenants
            _private_directory(home / tenant, 0o700 if group is None else 0o750, group)
        except OSError as exc:
            raise ConfigError(f"kv_events.directory: {exc}") from exc
        endpoint, replay = f"ipc://{home / tenant / 'pub'}", f"ipc://{home / tenant / 'replay'}"
    return PublisherSettings(
        endpoint=endpoint,
        replay_endpoint=replay,
        topic=kv.topic,
        buffer_batches=kv.buffer_batches,
        buffer_bytes=kv.buffer_bytes,
        queue_batches=kv.queue_batches,
        hwm=kv.hwm,
        dp_rank=kv.data_parallel_rank,
        max_peers=kv.max_peers,
        first_seq=first_seq,
        socket_mode=0o600 if group is None else 0o660,
        socket_group=group,
    )


def _private_directory(path: Path, mode: int, group: int | None = None) -> None:
    """``path`` made (or taken, when this user's and nobody else may write in it) with
    ``mode`` and ``group``."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    check_directory(str(path), "KV-event socket")
    if group is not None:
        os.chown(path, -1, group)
    os.chmod(path, mode)


async def _keep(tenant: KvTenant, where: Path) -> None:
    """Read the tenant's descriptions back and keep its book in ``where`` from now on."""
    book = tenant.book
    restored = await asyncio.to_thread(read_book, where)
    book.restore(restored)
    tenant.restored = list(restored)
    file = BookFile(where, book.row_parts)
    await asyncio.to_thread(file.start)
    book.on_records = lambda records: file.changed(records, book.bytes_used)
    tenant.file = file
