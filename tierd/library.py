"""The in-process entry point: build stores, tiers, transfer engine and chain from config.

::

    async with tierd.open("tierd.yaml") as chain:
        await chain.store(keys, data)
        async with chain.loading(keys) as handle:
            views = handle.views()

Closing releases everything in reverse order of opening; a disk tier persists its index
and is rebuilt from it (or from the slab, after a crash) on the next open.
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from tierd.chain import Admission, Level, TierChain
from tierd.chain.remote import RemoteLevel, RemoteSide
from tierd.config import ChainConfig, RemoteConfig, S3Config, TierConfig, TierKind, load_config
from tierd.errors import ConfigError, StoreIOError, TierdError
from tierd.keys import BlockKey
from tierd.logs import get_logger
from tierd.remote.level import LevelBase
from tierd.stores import BlockStore
from tierd.stores.cpu import CpuStore, StartProgress
from tierd.stores.cuda import torch_missing_reason
from tierd.stores.disk.store import DiskStore
from tierd.stores.memory import MemoryStore
from tierd.tier import Tier, one_slot_per_key
from tierd.transfer import TransferEngine
from tierd.turns import ADOPT_BLOCKS

__all__ = [
    "adopt_kept",
    "build_store",
    "open_chain",
    "open_remote",
    "restore_tier",
]

log = get_logger("tierd")
Kept = tuple[BlockKey, int]  # (key, slot) of a block a persistent store kept across a restart
_PROGRESS_EVERY_S = 5.0


def build_store(
    spec: TierConfig,
    num_blocks: int,
    block_bytes: int,
    *,
    gpu: str | None = None,
    progress: StartProgress | None = None,
) -> BlockStore:
    """An unopened store for one configured tier (a CPU pool is a sealed memfd: no path).

    ``gpu``: the device of the chain's GPU tier, if it has one. A CPU pool is page-locked
    only then, or when this process uses torch already (a library caller's tensors): the
    daemon's pinned pages serve only its own CUDA copies, and pinning would load torch and
    make a CUDA context for nothing. ``progress``: a CPU pool's start-up progress.
    """
    if spec.kind is TierKind.MEMORY:
        return MemoryStore(num_blocks=num_blocks, block_bytes=block_bytes)
    if spec.kind is TierKind.CPU:
        device = _device_index(gpu)
        return CpuStore(
            num_blocks=num_blocks,
            block_bytes=block_bytes,
            name=spec.shm_name,
            memfd=True,
            pin=gpu is not None or "torch" in sys.modules,
            pin_device=device,
            progress=progress,
        )
    if spec.kind is TierKind.GPU:
        if (missing := torch_missing_reason()) is not None:
            where = spec.device or "cuda"
            message = f"cannot open a GPU store: {missing}"
            raise StoreIOError(message, path=where, errno=errno.ENOPKG, medium="GPU")
        from tierd.stores.gpu import GpuStore  # torch: the GPU extra's, loaded only here

        return GpuStore(num_blocks=num_blocks, block_bytes=block_bytes, device=spec.device or "")
    for directory in spec.directories:
        # Create the tier's own directory, never its parents: a missing mount point
        # must fail loudly rather than fill the root file system.
        if directory.parent.is_dir():
            directory.mkdir(mode=0o700, exist_ok=True)
    o_direct: Any = spec.o_direct
    return DiskStore(
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        directories=[str(d) for d in spec.directories],
        o_direct=o_direct,
        fsync=spec.fsync,
        fsync_interval=spec.fsync_interval,
    )


def _device_index(device: str | None) -> int | None:
    if device is None or ":" not in device:
        return None
    return int(device.split(":", 1)[1])


def restore_tier(tier: Tier, store: BlockStore, *, inline: int | None = None) -> list[Kept]:
    """Adopt the blocks a persistent store kept across a restart; returns them. Over
    ``inline`` blocks (None: no bound) they are only reserved (:meth:`Tier.reserve`) and
    returned for :func:`adopt_kept` to adopt while the daemon serves: at a million blocks
    the adoption costs seconds, reserving a tenth of a second."""
    if not isinstance(store, DiskStore):
        return []
    index = store.index()
    if inline is not None and len(index) > inline:
        reserved = list(zip(index.values(), index.keys(), strict=True))
        tier.reserve(reserved, store.invalidate)  # a kept block deleted is forgotten there
        return reserved
    listed = list(zip(index.values(), index.keys(), strict=True))
    entries, duplicates = one_slot_per_key(listed)
    if duplicates:  # other copies of a block: the same rule as reserve's
        store.invalidate(duplicates)
    kept = list(entries.items())
    tier.restore(kept)
    return kept


async def adopt_kept(tier: Tier, rate: int) -> None:
    """Adopt the blocks ``tier`` reserved in slices, yielding to the loop between slices
    (and, with ``rate``, pacing to at most that many blocks a second). A key stored
    again, deleted or cleared meanwhile keeps its new state: the tier has the store
    forget the kept copy. Cancelled (the chain closing), the rest stays in the store for
    the next start."""
    step = max(1, min(ADOPT_BLOCKS, rate // 10)) if rate else ADOPT_BLOCKS
    started = last = time.monotonic()
    total, adopted = tier.adopting, 0
    while tier.adopting:
        took = tier.adopt(step)  # visits ``step`` positions, blocks dropped ones included
        adopted += took
        if time.monotonic() - last >= _PROGRESS_EVERY_S:
            last = time.monotonic()
            log.info("adopting kept blocks", tier=tier.name, adopted=adopted, left=tier.adopting)
        await asyncio.sleep(took / rate if rate else 0)  # paced by the blocks taken
    log.info(
        "kept blocks adopted",
        tier=tier.name,
        blocks=adopted,
        dropped=total - adopted,
        seconds=round(time.monotonic() - started, 3),
    )


async def _stop_task(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.wait([task])  # never raises: the chain closes whatever the task did


@asynccontextmanager
async def open_chain(
    config: ChainConfig | Path | str | dict[str, Any], *, progress: StartProgress | None = None
) -> AsyncIterator[TierChain]:
    """Open every store of ``config`` (a model, a YAML path or a mapping) and yield the
    chain; closes them in reverse order on exit. ``progress``: see :func:`build_store`."""
    cfg = config if isinstance(config, ChainConfig) else load_config(config, ChainConfig)
    gpus = [t.device or "cuda" for t in cfg.tiers if t.kind is TierKind.GPU]
    gpu = gpus[0] if gpus else None
    async with AsyncExitStack() as stack:
        levels: list[Level] = []
        for spec in cfg.tiers:
            num_blocks = spec.num_blocks(cfg.block_bytes)
            try:
                store = await stack.enter_async_context(
                    build_store(spec, num_blocks, cfg.block_bytes, gpu=gpu, progress=progress)
                )
            except TierdError as exc:  # name the tier: a config may have several alike
                exc.args = (f"tier {spec.name!r} ({spec.kind}): {exc}", *exc.args[1:])
                raise
            tier = Tier(num_blocks, spec.policy, name=spec.name, medium=spec.kind.medium)
            restored = restore_tier(tier, store, inline=spec.adopt_inline)
            if tier.adopting:
                task = asyncio.create_task(
                    adopt_kept(tier, spec.adopt_rate), name=f"adopt-{spec.name}"
                )
                stack.push_async_callback(_stop_task, task)
                restored = []
            log.info(
                "tier opened",
                tier=spec.name,
                medium=str(tier.medium),
                blocks=num_blocks,
                policy=spec.policy,
                restored=len(restored),
                adopting=tier.adopting,
            )
            admission = Admission.parse(spec.admission)
            levels.append(Level(tier, store, spec.write_through, admission, spec.write_behind))
        engine = await stack.enter_async_context(
            TransferEngine(budget_bytes=max(cfg.transfer.budget_per_route, cfg.block_bytes))
        )
        remote = None
        if cfg.remote is not None:
            remote = RemoteSide(await open_remote(cfg.remote, cfg.block_bytes))
            remote.admission = Admission.parse(cfg.remote.admission)
            stack.push_async_callback(remote.level.close)
        chain = TierChain(levels, engine, entry=cfg.entry_index, remote=remote)
        stack.push_async_callback(chain.close)  # before the stores close: copies end first
        yield chain


async def open_remote(spec: RemoteConfig | S3Config, block_bytes: int) -> RemoteLevel:
    """The remote level of ``spec`` (with the levels chained below it, if any), opened;
    its client library loads only here."""
    from tierd.remote.stack import RemoteStack

    levels = []
    try:
        for depth, level in enumerate(spec.levels()):
            path = "remote" + ".below" * depth
            levels.append(await _open_level(level, block_bytes, path))
    except BaseException:
        for opened in levels:
            await opened.close()
        raise
    return levels[0] if len(levels) == 1 else RemoteStack(levels)


async def _open_level(spec: RemoteConfig | S3Config, block_bytes: int, path: str) -> LevelBase:
    if isinstance(spec, S3Config):
        return await _open_s3(spec, block_bytes, path)
    from tierd.remote.calls import RemoteSettings
    from tierd.remote.redis_level import RedisLevel

    settings = RemoteSettings(
        name=spec.name,
        block_bytes=block_bytes,
        url=spec.url,
        cluster_nodes=tuple(spec.cluster_nodes or ()),
        key_prefix=spec.key_prefix,
        pool_size=spec.pool_size,
        deadline_s=spec.deadline,
        ttl_s=spec.ttl,
        max_pending_bytes=spec.max_pending_writes,
        breaker_failures=spec.breaker_failures,
        breaker_backoff_s=spec.breaker_backoff,
        breaker_max_backoff_s=spec.breaker_max_backoff,
    )
    return await RedisLevel(settings).open()


async def _open_s3(spec: S3Config, block_bytes: int, path: str) -> LevelBase:
    from tierd.remote.s3_calls import S3Settings
    from tierd.remote.s3_level import S3Level

    key_id, secret = s3_credentials(spec)
    settings = S3Settings(
        name=spec.name,
        block_bytes=block_bytes,
        bucket=spec.bucket,
        endpoint=spec.endpoint,
        region=spec.region,
        key_prefix=spec.key_prefix,
        access_key_id=key_id,
        secret_access_key=secret,
        pool_size=spec.pool_size,
        deadline_s=spec.deadline,
        max_pending_bytes=spec.max_pending_writes,
        breaker_failures=spec.breaker_failures,
        breaker_backoff_s=spec.breaker_backoff,
        breaker_max_backoff_s=spec.breaker_max_backoff,
        write_once=spec.write_once,
        config_path=path,
    )
    return await S3Level(settings).open()


def s3_credentials(spec: S3Config) -> tuple[str | None, str | None]:
    """The access key and secret of ``spec``: from the config (the secret from its file,
    :func:`private_secret`), else from the environment, else none (the client's own
    chain: a profile, an instance role)."""
    if spec.access_key_id is not None and spec.secret_access_key_file is not None:
        return spec.access_key_id, private_secret(spec.secret_access_key_file)
    env_id = os.environ.get("AWS_ACCESS_KEY_ID")
    env_secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
    if env_id and env_secret:
        return env_id, env_secret
    return None, None


def private_secret(path: Path) -> str:
    """The secret in ``path``, a regular file of the daemon's own user that nobody else
    may read; a link is followed only when the daemon's user or root owns it (another
    user's link could be pointed at any file, and a root daemon would read it), and the
    file it names is checked, never the link."""
    where = "remote.secret_access_key_file"
    me = os.geteuid()
    try:
        link = path.lstat()
        if stat.S_ISLNK(link.st_mode) and link.st_uid not in (0, me):
            raise ConfigError(
                f"{path} is a link that uid {link.st_uid} owns, not the daemon's user"
                f" (uid {me}): name the file itself",
                path=where,
            )
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
        with os.fdopen(fd, encoding="utf-8") as f:
            found = os.fstat(f.fileno())
            if not stat.S_ISREG(found.st_mode):
                raise ConfigError(f"{path} is not a regular file", path=where)
            if found.st_uid != me:
                raise ConfigError(
                    f"{path} belongs to uid {found.st_uid}, not the daemon's user (uid {me}):"
                    f" chown it to uid {me} and chmod 600 it",
                    path=where,
                )
            if found.st_mode & 0o077:
                raise ConfigError(f"{path} is readable by others: chmod 600 it", path=where)
            return f.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}", path=where) from exc
