"""The daemon's config: the chain plus the sections only ``tierd serve`` reads.

:class:`DaemonConfig` is a :class:`~tierd.config.chain.ChainConfig` with the socket and who
may use it, limits on clients, namespaces, logging, metrics, shutdown, events and tenants;
every field has a default. :func:`tenant_chain` cuts the chain down to one tenant's part
(:mod:`tierd.tenancy`); :func:`default_socket_path` is where a daemon listens, and where
clients look, when nothing says otherwise.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tierd.config.base import Mode, Seconds, Size, StrictModel, error_at, errors_at
from tierd.config.chain import ChainConfig, TierConfig, TierKind
from tierd.config.kv_events import KvEventsConfig
from tierd.control.socketfile import bind_path_bytes, default_socket_path
from tierd.errors import ConfigError
from tierd.tenancy import DEFAULT_TENANT, QuotaProblem, TenantConfig, quota_blocks
from tierd.units import share_parts

__all__ = [
    "SOCKET_PATH_MAX",
    "DaemonConfig",
    "EventsConfig",
    "LimitsConfig",
    "LoggingConfig",
    "MetricsConfig",
    "NamespaceConfig",
    "ShutdownConfig",
    "SocketConfig",
    "MAX_SIZE_CLASSES",
    "default_socket_path",
    "size_class_chain",
    "tenant_chain",
]


class SocketConfig(StrictModel):
    """The control socket, and who may use it.

    ``mode`` applies to the socket file (pools have no file: each tenant's is a memfd
    passed to its clients). Without a ``tenants:`` section a connecting peer
    (``SO_PEERCRED``) is admitted when its uid is the daemon's own uid (an operator), or
    is in ``allow_uids``, or its gid is in ``allow_gids`` (members of the one tenant);
    with one, the tenants name who is admitted (:mod:`tierd.tenancy`)."""

    path: Path = Field(default_factory=default_socket_path)
    pid_file: Path | None = None  # default: the socket path + ".pid"
    mode: Mode = 0o600
    allow_uids: list[int] = Field(default_factory=list)
    allow_gids: list[int] = Field(default_factory=list)

    @field_validator("path")
    @classmethod
    def _path(cls, value: Path) -> Path:
        size = len(os.fsencode(value))
        if size > SOCKET_PATH_MAX:
            raise ValueError(
                f"a Unix socket path is at most {SOCKET_PATH_MAX} bytes, this one is {size}:"
                " choose a shorter directory"
            )
        # The socket is bound in a fresh directory beside it, then renamed into place:
        # that longer path is the one that must fit.
        bound = bind_path_bytes(str(value))
        if bound > SOCKET_PATH_MAX:
            raise ValueError(
                f"the socket is bound at a {bound}-byte path in its directory before it is"
                f" renamed, over the {SOCKET_PATH_MAX} bytes a Unix socket path may have:"
                " choose a shorter directory"
            )
        return value


class LimitsConfig(StrictModel):
    """Bounds on what one client can ask of the daemon."""

    max_frame_bytes: Size = Field(default=64 << 20, ge=4096)
    max_keys_per_request: int = Field(default=4096, ge=1)
    max_connections: int = Field(default=1024, ge=1)
    max_requests_in_flight: int = Field(default=256, ge=1, le=1 << 20)
    hello_timeout_s: Seconds = Field(default=5.0, gt=0, le=3600)
    frame_deadline_s: Seconds = Field(default=30.0, gt=0, le=3600)
    partial_frame_bytes: Size = Field(default=256 << 20, ge=4096)
    output_buffer_bytes: Size = Field(default=16 << 20, ge=4096)
    output_stall_s: Seconds = Field(default=60.0, gt=0, le=86400)
    # Blocks one connection, and one tenant's connections together, may hold in open
    # leases (reserved for a store, pinned by a load): a count, or a share of the
    # tenant's entry tier. The rest stays free for other clients and for promotions.
    lease_blocks_per_connection: int | str = "50%"
    lease_blocks_per_tenant: int | str = "75%"
    store_lease_ttl_s: Seconds = Field(default=30.0, gt=0, le=86400)  # then it is aborted
    load_wait_s: Seconds = Field(default=5.0, gt=0, le=3600)  # on another client's store
    # Region jobs (region_store, region_load) of one tenant, all its connections together,
    # that run at once; the others wait their turn, costing the loop nothing meanwhile.
    region_jobs_per_tenant: int = Field(default=8, ge=1, le=4096)
    # Namespace names a tenant may have (kept across restarts): a hello naming a new one
    # past this is refused (too_many_namespaces); names already used keep working.
    namespaces_per_tenant: int = Field(default=256, ge=1, le=1 << 20)
    # The smallest block size a hello may open (block_sizes above 1): every block costs
    # the daemon a few hundred bytes of bookkeeping, so a tiny size in a large share
    # would cost it far more memory than the operator's block_bytes does.
    min_block_bytes: Size = Field(default=16 << 10, ge=4096, le=1 << 30)
    # A block size besides the configured one that no connection has used for this long
    # is given back (its share, its blocks and its slab) when a hello names a new size
    # and every size's room is taken (block_sizes above 1).
    block_size_idle_s: Seconds = Field(default=300.0, ge=0, le=30 * 86400)

    @field_validator("lease_blocks_per_connection", "lease_blocks_per_tenant")
    @classmethod
    def _lease_blocks(cls, value: int | str) -> int | str:
        try:
            share_parts(value)
        except ValueError as exc:
            raise ValueError(
                f"a lease bound is a positive block count or a share like '50%' ({exc})"
            ) from None
        return value


class NamespaceConfig(StrictModel):
    """Which namespace names clients may use: the whole name must match ``pattern`` and,
    when ``allowed`` is not empty, be one of its entries."""

    pattern: str = r"^[A-Za-z0-9_.:/@+=-]{1,128}$"
    allowed: list[str] = Field(default_factory=list)

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"pattern is not a valid regular expression: {exc}") from None
        return value

    @model_validator(mode="after")
    def _allowed(self) -> NamespaceConfig:
        problems = [
            (f"allowed.{index}", f"{name!r} does not match {self.pattern}")
            for index, name in enumerate(self.allowed)
            if re.fullmatch(self.pattern, name) is None
        ]
        if problems:
            raise errors_at(problems)
        return self

    def check(self, name: str) -> str | None:
        """Why ``name`` is refused, or ``None`` when it is a valid namespace."""
        if re.fullmatch(self.pattern, name) is None:
            return f"namespace {name!r} does not match {self.pattern}"
        if self.allowed and name not in self.allowed:
            return f"namespace {name!r} is not allowed (allowed: {', '.join(self.allowed)})"
        return None


class LoggingConfig(StrictModel):
    """``format: auto`` logs JSON when stderr is not a terminal, key-value when it is."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"


class MetricsConfig(StrictModel):
    """The Prometheus endpoint: off unless ``http_port`` is set; loopback only."""

    http_port: int | None = Field(default=None, ge=1, le=65535)
    http_host: str = "127.0.0.1"
    # Namespaces with labels of their own (most bytes first); the rest add up in "other".
    namespaces_top: int = Field(default=20, ge=0, le=1000)
    # A scrape within this many seconds of the last rendering gets that rendering: any
    # number of scrapers cost the event loop one rendering per interval.
    cache: Seconds = Field(default=1.0, ge=0, le=3600)

    @field_validator("http_host")
    @classmethod
    def _loopback(cls, value: str) -> str:
        if value == "localhost":
            return value
        try:
            loopback = ipaddress.ip_address(value).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError("http_host must be a loopback address (127.0.0.1, ::1, localhost)")
        return value


class ShutdownConfig(StrictModel):
    """On SIGTERM: ``grace`` seconds to drain in-flight work; then ``write_back: flush``
    copies dirty blocks down to the last tier so they survive a restart (``none`` drops
    them)."""

    grace: Seconds = Field(default=10.0, gt=0, le=86400)
    write_back: Literal["none", "flush"] = "flush"


class EventsConfig(StrictModel):
    """Each event subscriber gets a queue of at most ``queue_batches`` event batches."""

    queue_batches: int = Field(default=1024, ge=1)


class TraceConfig(StrictModel):
    """Recording live traffic (off by default): each sampled lookup as one Mooncake JSON
    line in ``directory``/<tenant>.jsonl, rotated at ``max_bytes``, ``keep`` old files
    kept. Requests are sampled whole by a hash of their first key (``sample``: the
    share kept). An operator turns it on and off at run time (``tierd record on|off``)."""

    enabled: bool = False
    directory: Path | None = None
    sample: float = Field(default=1.0, gt=0, le=1)
    max_bytes: Size = Field(default=64 << 20, ge=4096)
    keep: int = Field(default=4, ge=0, le=1000)

    @model_validator(mode="after")
    def _where(self) -> TraceConfig:
        if self.enabled and self.directory is None:
            raise error_at("directory", "recording is enabled: name a directory")
        return self


MAX_SIZE_CLASSES = 16  # block sizes one daemon serves at once, at most
_PAGE = 4096


def _default_tiers() -> list[TierConfig]:
    return [TierConfig(name="cpu", kind=TierKind.CPU, capacity="1GiB", policy="lru")]


class DaemonConfig(ChainConfig):
    """What ``tierd serve`` runs: the chain plus the daemon's sections. Every field has a
    default, so ``DaemonConfig()`` is a valid config (one 1GiB CPU tier)."""

    tiers: list[TierConfig] = Field(default_factory=_default_tiers, min_length=1)
    socket: SocketConfig = Field(default_factory=SocketConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    namespaces: NamespaceConfig = Field(default_factory=NamespaceConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    shutdown: ShutdownConfig = Field(default_factory=ShutdownConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    tenants: list[TenantConfig] = Field(default_factory=list)  # see tierd.tenancy
    trace: TraceConfig = Field(default_factory=TraceConfig)
    kv_events: KvEventsConfig = Field(default_factory=KvEventsConfig)
    # Size classes: how many block sizes each tenant's tiers serve at once, each an equal
    # share of every tier (see size_class_chain). 1: only ``block_bytes``.
    block_sizes: int = Field(default=1, ge=1, le=MAX_SIZE_CLASSES)

    @model_validator(mode="after")
    def _tenants(self) -> DaemonConfig:
        if not self.tenants:
            return self
        problems: list[tuple[str, str]] = []
        if self.socket.allow_uids or self.socket.allow_gids:
            problems.append(
                (
                    "socket.allow_uids" if self.socket.allow_uids else "socket.allow_gids",
                    "with tenants, list who may connect in tenants.N.uids and tenants.N.gids",
                )
            )
        problems += _tenant_problems(self.tenants)
        if not problems:
            try:
                self.tenant_blocks()
            except QuotaProblem as problem:
                problems.append((problem.path, problem.message))
        if problems:
            raise errors_at(problems)
        return self

    @model_validator(mode="after")
    def _published_tenants(self) -> DaemonConfig:
        names = {t.name for t in self.tenants} or {DEFAULT_TENANT}
        unknown = [n for n in self.kv_events.tenants if n != "*" and n not in names]
        if unknown:
            raise error_at("kv_events.tenants", f"no tenant named {', '.join(map(repr, unknown))}")
        order = [t.name for t in self.tenants] or [DEFAULT_TENANT]
        published = [name for name in order if self.kv_events.publishes(name)]
        problems = self.kv_events.problems(published, self.socket.path.parent)
        if problems:
            raise errors_at(problems)
        return self

    def tenant_blocks(self) -> dict[str, dict[str, int]]:
        """Blocks of each tier for each configured tenant (see :mod:`tierd.tenancy`)."""
        tiers = [(tier.name, tier.num_blocks(self.block_bytes)) for tier in self.tiers]
        return quota_blocks(self.tenants, tiers, self.block_bytes)

    @property
    def entry_index(self) -> int:
        """Socket clients store into the first CPU tier unless ``entry`` names another."""
        names = [t.name for t in self.tiers]
        return names.index(self.entry or socket_entry(self.tiers))

    def tenant_chains(self) -> list[tuple[TenantConfig, ChainConfig]]:
        """Each tenant with the chain it gets: without a ``tenants:`` section, the one
        ``default`` tenant (the daemon's own user, an operator) with this chain as it is;
        with it, each tenant's part of it (:func:`tenant_chain`)."""
        if not self.tenants:
            own = TenantConfig(name=DEFAULT_TENANT, uids=[os.getuid()], operator=True)
            return [(own, self)]
        blocks = self.tenant_blocks()
        return [(t, tenant_chain(self, t.name, blocks[t.name])) for t in self.tenants]

    @model_validator(mode="after")
    def _frame_fits_a_block(self) -> DaemonConfig:
        need = self.block_bytes + (64 << 10)
        if self.limits.max_frame_bytes < need:
            message = (
                f"{self.limits.max_frame_bytes} is too small for an inline put of one block: "
                f"it must be at least block_bytes + 64KiB ({need})"
            )
            raise error_at("limits.max_frame_bytes", message)
        return self


def _tenant_problems(tenants: list[TenantConfig]) -> list[tuple[str, str]]:
    """Names given twice, tenants nobody could use, and ids in two tenants."""
    problems: list[tuple[str, str]] = []
    seen: dict[str, dict[int, str]] = {"uids": {}, "gids": {}}
    names: set[str] = set()
    for index, tenant in enumerate(tenants):
        if tenant.name in names:
            problems.append((f"tenants.{index}.name", f"{tenant.name!r} is named twice"))
        names.add(tenant.name)
        if not tenant.uids and not tenant.gids:
            problems.append((f"tenants.{index}", "names no uid or gid: nobody could use it"))
        for field, ids in (("uids", tenant.uids), ("gids", tenant.gids)):
            for value in ids:
                other = seen[field].setdefault(value, tenant.name)
                if other != tenant.name:
                    message = f"{value} is also in tenant {other!r}: a peer has one tenant"
                    problems.append((f"tenants.{index}.{field}", message))
    return problems


def size_class_chain(cfg: ChainConfig, block_bytes: int, classes: int) -> ChainConfig:
    """``cfg`` (a tenant's chain at the configured ``block_bytes``) cut to one of
    ``classes`` equal shares of every tier's bytes, holding blocks of ``block_bytes``.

    The configured size keeps the tenant's own disk slabs and pool name; any other size
    gets a slab in ``<directory>/blocks-<bytes>``, a pool named after it, and remote keys
    under ``b<bytes>:``, so that two sizes never meet in one store. A share that holds no
    block of the size raises :class:`ConfigError` naming the tier."""
    own = block_bytes == cfg.block_bytes
    tiers = []
    footprint = -(-block_bytes // _PAGE) * _PAGE  # a slot is page-aligned in every store
    for tier in cfg.tiers:
        share = tier.num_blocks(cfg.block_bytes) * cfg.block_bytes // classes
        blocks = tier.num_blocks(cfg.block_bytes) // classes if own else share // footprint
        if blocks < 1:
            raise ConfigError(
                f"tier {tier.name!r}: its share of {share} bytes (one of {classes} block sizes)"
                f" holds no block of {block_bytes} bytes",
                path=f"tiers.{tier.name}.capacity",
            )
        update: dict[str, Any] = {"capacity": blocks}
        if not own:
            update["directories"] = [d / f"blocks-{block_bytes}" for d in tier.directories]
            update["shm_name"] = f"{tier.shm_name or 'tierd'}-{block_bytes}"
        tiers.append(tier.model_copy(update=update))
    remote = cfg.remote
    if remote is not None and not own:
        remote = remote.with_prefix(f"b{block_bytes}:")
    return cfg.model_copy(update={"block_bytes": block_bytes, "tiers": tiers, "remote": remote})


def tenant_chain(cfg: ChainConfig, tenant: str, blocks: Mapping[str, int]) -> ChainConfig:
    """``cfg`` cut down to one tenant's part: each tier its ``blocks`` (by tier name), a
    pool named after the tenant, each disk directory a subdirectory of the tenant's own,
    and the remote level's keys under a prefix of the tenant's own."""
    tiers = [
        tier.model_copy(
            update={
                "capacity": blocks[tier.name],
                "directories": [directory / tenant for directory in tier.directories],
                "shm_name": f"{tier.shm_name or 'tierd'}-{tenant}",
            }
        )
        for tier in cfg.tiers
    ]
    remote = None if cfg.remote is None else cfg.remote.with_prefix(f"{tenant}:")
    return ChainConfig(
        block_bytes=cfg.block_bytes,
        tiers=tiers,
        entry=cfg.entry or socket_entry(cfg.tiers),
        transfer=cfg.transfer,
        remote=remote,
    )


def socket_entry(tiers: list[TierConfig]) -> str:
    """The daemon's default entry tier: the first CPU tier (its pool is what socket clients
    map; a GPU tier in the daemon's process is memory no client can reach), else the first
    tier."""
    for tier in tiers:
        if tier.kind is TierKind.CPU:
            return tier.name
    return tiers[0].name


# sun_path holds 108 bytes with the terminating NUL (Linux's sockaddr_un).
SOCKET_PATH_MAX = 107
