"""Configuration: YAML -> strict pydantic models.

Only this layer reads files and environment variables; everything below takes plain
constructor arguments. This module owns the models: :class:`ChainConfig` (the chain, also what
the library opens) and :class:`DaemonConfig` (the chain plus the daemon's sections: socket,
limits, namespaces, logging, metrics, shutdown, events). Where the daemon's values come from
(file, ``TIERD_*`` environment, ``--set``) is :mod:`tierd.settings`.

Sizes are bytes (``4096``) or strings with a unit (``"64GiB"``, ``"2 MiB"``, ``"512KB"``);
a tier's ``capacity`` is a number of blocks (``4096`` or ``"4096 blocks"``) or a size
(``"64GiB"``, divided by ``block_bytes``); durations are seconds or ``"10s"``, ``"500ms"``,
``"2m"``; permission modes are octal (``0o600``, ``"0600"``, ``"600"``). Unknown keys are
errors. :func:`load_config` turns every validation problem into a :class:`ConfigError`
whose lines name the YAML path (``tiers.1.policy``), the bad value and what is allowed.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, cast

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tierd.configfile import AT_PATH, expand_path, format_validation_error, read_config_file
from tierd.errors import ConfigError
from tierd.keys import Medium
from tierd.policy import policy_names
from tierd.policy.admission import Admission
from tierd.tenancy import DEFAULT_TENANT, QuotaProblem, TenantConfig, quota_blocks
from tierd.units import (
    MAX_BLOCKS,
    capacity_parts,
    parse_mode,
    parse_seconds,
    parse_size,
    share_parts,
)

__all__ = [
    "ChainConfig",
    "DaemonConfig",
    "EventsConfig",
    "LimitsConfig",
    "LoggingConfig",
    "MetricsConfig",
    "NamespaceConfig",
    "RemoteConfig",
    "ShutdownConfig",
    "SocketConfig",
    "TierConfig",
    "TierKind",
    "TransferConfig",
    "default_socket_path",
    "format_validation_error",
    "load_config",
    "parse_mode",
    "parse_seconds",
    "parse_size",
    "read_config_file",
]

_M = TypeVar("_M", bound=BaseModel)

Size = Annotated[int, BeforeValidator(parse_size)]
Mode = Annotated[int, BeforeValidator(parse_mode)]
Seconds = Annotated[float, BeforeValidator(parse_seconds)]
_AT = AT_PATH  # the error type of _error_at: format_validation_error reads its path


def _error_at(path: str, message: str) -> PydanticCustomError:
    """A validation error at ``path`` below the model whose validator raises it (a model
    validator's own errors would otherwise point at the whole model)."""
    return PydanticCustomError(_AT, "{message}", {"path": path, "message": message})


class TierKind(StrEnum):
    MEMORY = "memory"
    CPU = "cpu"
    GPU = "gpu"
    DISK = "disk"

    @property
    def medium(self) -> Medium:
        return Medium(self.value.upper())


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TierConfig(_Strict):
    """One level of the chain."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    kind: TierKind
    capacity: int | str = Field(description="blocks (4096, '4096 blocks') or bytes ('64GiB')")
    policy: str = "lru"
    write_through: bool = False
    admission: str = "always"
    device: str | None = None  # gpu: "cuda:0" (or "cpu" for development)
    # disk: one slab file each; "~", "$VAR" and "${VAR:-default}" are expanded
    directories: list[Path] = Field(default_factory=list)
    o_direct: bool | str = "auto"  # disk: true, false or "auto" (probe)
    shm_name: str | None = None  # cpu: the pool's name, seen as /memfd:NAME in /proc/PID/maps

    @field_validator("directories", mode="before")
    @classmethod
    def _expand(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        return [expand_path(v) if isinstance(v, str | Path) else v for v in value]

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        if value not in policy_names():
            raise ValueError(f"policy {value!r} is not one of: {', '.join(policy_names())}")
        return value

    @field_validator("admission")
    @classmethod
    def _admission(cls, value: str) -> str:
        Admission.parse(value)
        return value

    @field_validator("o_direct")
    @classmethod
    def _o_direct(cls, value: bool | str) -> bool | str:
        if value not in (True, False, "auto"):
            raise ValueError("o_direct must be true, false or 'auto'")
        return value

    @field_validator("capacity")
    @classmethod
    def _capacity(cls, value: int | str) -> int | str:
        capacity_parts(value)
        return value

    @field_validator("shm_name")
    @classmethod
    def _shm_name(cls, value: str | None) -> str | None:
        if value is not None and (not _SHM_NAME.match(value) or value in (".", "..")):
            raise ValueError(
                "shm_name names the pool (/memfd:NAME in /proc/PID/maps): letters,"
                " digits, '_', '.', '-', at most 200 characters, no '/'"
            )
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str | None) -> str | None:
        if value is not None and not _DEVICE.match(value):
            raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {value[:40]!r}")
        return value

    @model_validator(mode="after")
    def _check(self) -> TierConfig:
        if self.kind is TierKind.DISK and not self.directories:
            raise _error_at("directories", "a disk tier needs at least one directory")
        if self.kind is not TierKind.DISK and self.directories:
            raise _error_at("directories", f"only applies to disk tiers, not {self.kind}")
        if self.kind is TierKind.GPU and self.device is None:
            raise _error_at("device", "a gpu tier needs a device ('cuda:0', or 'cpu' to test)")
        return self

    def num_blocks(self, block_bytes: int) -> int:
        """The capacity in blocks for blocks of ``block_bytes``."""
        count, is_bytes = capacity_parts(self.capacity)
        blocks = count // block_bytes if is_bytes else count
        if blocks <= 0:
            raise ConfigError(
                f"capacity {self.capacity!r} holds no block of {block_bytes} bytes",
                path=f"tiers.{self.name}.capacity",
            )
        return blocks


class RemoteConfig(_Strict):
    """The shared level below the last local tier: a Redis-protocol server or cluster.

    The server owns eviction (``maxmemory`` with ``allkeys-lru`` or ``allkeys-lfu``), so
    the remote level has no capacity here and the daemon keeps no index of it."""

    kind: Literal["redis"] = "redis"
    name: str = Field(default="remote", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    url: str | None = None  # redis://host:port/db, rediss://..., unix:///path?db=0
    cluster_nodes: list[str] | None = None  # "host:port" seeds of a cluster
    key_prefix: str = Field(default="tierd:", max_length=256)
    pool_size: int = Field(default=16, ge=1, le=1024)
    deadline: Seconds = Field(default=0.1, gt=0, le=60)  # per call
    ttl: Seconds = Field(default=0.0, ge=0)  # 0: keys never expire (the server evicts)
    admission: str = "always"
    max_pending_writes: Size = Field(default=64 << 20, ge=0)  # bytes queued to write
    breaker_failures: int = Field(default=3, ge=1)
    breaker_backoff: Seconds = Field(default=0.5, gt=0)
    breaker_max_backoff: Seconds = Field(default=30.0, gt=0)

    @field_validator("admission")
    @classmethod
    def _admission(cls, value: str) -> str:
        Admission.parse(value)
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url must start with redis://, rediss:// or unix://, got {value!r}")
        return value

    @field_validator("cluster_nodes")
    @classmethod
    def _nodes(cls, value: list[str] | None) -> list[str] | None:
        for node in value or ():
            host, _, port = node.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"a cluster node is 'host:port', got {node!r}")
        return value

    @model_validator(mode="after")
    def _check(self) -> RemoteConfig:
        if (self.url is None) == (not self.cluster_nodes):
            raise _error_at("url", "give exactly one of url and cluster_nodes")
        if self.breaker_max_backoff < self.breaker_backoff:
            raise _error_at("breaker_max_backoff", "must be at least breaker_backoff")
        return self


class TransferConfig(_Strict):
    budget_per_route: Size = 256 << 20


class ChainConfig(_Strict):
    """The chain: block size, levels fastest first, and where stores enter."""

    block_bytes: Size = 2 << 20
    tiers: list[TierConfig] = Field(min_length=1)
    entry: str | None = None  # tier name; default: the first tier
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    remote: RemoteConfig | None = None  # a shared level below the last tier

    @field_validator("remote", mode="before")
    @classmethod
    def _remote(cls, value: Any) -> Any:
        return None if value in ({}, None) else value

    @model_validator(mode="after")
    def _check(self) -> ChainConfig:
        if not 0 < self.block_bytes <= MAX_BLOCK_BYTES:
            message = f"must be between 1 byte and 1GiB ({MAX_BLOCK_BYTES:,} bytes)"
            raise _error_at("block_bytes", message)
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise _error_at("tiers", f"tier names must be unique, got {names}")
        if self.remote is not None and self.remote.name in names:
            raise _error_at("remote.name", f"{self.remote.name!r} is also a tier's name")
        if self.entry is not None and self.entry not in names:
            raise _error_at("entry", f"{self.entry!r} is not a tier name ({', '.join(names)})")
        for index, tier in enumerate(self.tiers):
            count, is_bytes = capacity_parts(tier.capacity)
            if is_bytes and count < self.block_bytes:
                message = f"{tier.capacity!r} holds no block of {self.block_bytes} bytes"
                raise _error_at(f"tiers.{index}.capacity", message)
            if is_bytes and count // self.block_bytes > MAX_BLOCKS:
                message = f"{tier.capacity!r} is more than {MAX_BLOCKS:,} blocks (2**40)"
                raise _error_at(f"tiers.{index}.capacity", message)
        return self

    @property
    def entry_index(self) -> int:
        names = [t.name for t in self.tiers]
        return 0 if self.entry is None else names.index(self.entry)


# -- the daemon's sections -------------------------------------------------------------------


def default_socket_path(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_RUNTIME_DIR/tierd/tierd.sock`` when that is set, else
    ``/tmp/tierd-<uid>/tierd.sock``: in a directory of this user's own, which the daemon
    creates 0700 and refuses when another user owns it (socket squatting)."""
    runtime = (os.environ if environ is None else environ).get("XDG_RUNTIME_DIR")
    directory = Path(runtime) / "tierd" if runtime else Path(f"/tmp/tierd-{os.getuid()}")
    return directory / "tierd.sock"


class SocketConfig(_Strict):
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
        return value


class LimitsConfig(_Strict):
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


class NamespaceConfig(_Strict):
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
        for index, name in enumerate(self.allowed):
            if re.fullmatch(self.pattern, name) is None:
                raise _error_at(f"allowed.{index}", f"{name!r} does not match {self.pattern}")
        return self

    def check(self, name: str) -> str | None:
        """Why ``name`` is refused, or ``None`` when it is a valid namespace."""
        if re.fullmatch(self.pattern, name) is None:
            return f"namespace {name!r} does not match {self.pattern}"
        if self.allowed and name not in self.allowed:
            return f"namespace {name!r} is not allowed (allowed: {', '.join(self.allowed)})"
        return None


class LoggingConfig(_Strict):
    """``format: auto`` logs JSON when stderr is not a terminal, key-value when it is."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"


class MetricsConfig(_Strict):
    """The Prometheus endpoint: off unless ``http_port`` is set; loopback only."""

    http_port: int | None = Field(default=None, ge=1, le=65535)
    http_host: str = "127.0.0.1"

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


class ShutdownConfig(_Strict):
    """On SIGTERM: ``grace`` seconds to drain in-flight work; then ``write_back: flush``
    copies dirty blocks down to the last tier so they survive a restart (``none`` drops
    them)."""

    grace: Seconds = Field(default=10.0, gt=0, le=86400)
    write_back: Literal["none", "flush"] = "flush"


class EventsConfig(_Strict):
    """Each event subscriber gets a queue of at most ``queue_batches`` event batches."""

    queue_batches: int = Field(default=1024, ge=1)


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

    @model_validator(mode="after")
    def _tenants(self) -> DaemonConfig:
        if not self.tenants:
            return self
        if self.socket.allow_uids or self.socket.allow_gids:
            raise _error_at(
                "socket.allow_uids" if self.socket.allow_uids else "socket.allow_gids",
                "with tenants, list who may connect in tenants.N.uids and tenants.N.gids",
            )
        seen: dict[str, dict[int, str]] = {"uids": {}, "gids": {}}
        names: set[str] = set()
        for index, tenant in enumerate(self.tenants):
            if tenant.name in names:
                raise _error_at(f"tenants.{index}.name", f"{tenant.name!r} is named twice")
            names.add(tenant.name)
            if not tenant.uids and not tenant.gids:
                raise _error_at(f"tenants.{index}", "names no uid or gid: nobody could use it")
            for field, ids in (("uids", tenant.uids), ("gids", tenant.gids)):
                for value in ids:
                    other = seen[field].setdefault(value, tenant.name)
                    if other != tenant.name:
                        message = f"{value} is also in tenant {other!r}: a peer has one tenant"
                        raise _error_at(f"tenants.{index}.{field}", message)
        try:
            self.tenant_blocks()
        except QuotaProblem as problem:
            raise _error_at(problem.path, problem.message) from None
        return self

    def tenant_blocks(self) -> dict[str, dict[str, int]]:
        """Blocks of each tier for each configured tenant (see :mod:`tierd.tenancy`)."""
        tiers = [(tier.name, tier.num_blocks(self.block_bytes)) for tier in self.tiers]
        return quota_blocks(self.tenants, tiers, self.block_bytes)

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
            raise _error_at("limits.max_frame_bytes", message)
        return self


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
    remote = cfg.remote
    if remote is not None:
        remote = remote.model_copy(update={"key_prefix": f"{remote.key_prefix}{tenant}:"})
    return ChainConfig(
        block_bytes=cfg.block_bytes,
        tiers=tiers,
        entry=cfg.entry,
        transfer=cfg.transfer,
        remote=remote,
    )


MAX_BLOCK_BYTES = 1 << 30
_SHM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_DEVICE = re.compile(r"^(cpu|cuda(:[0-9]{1,3})?)$")
# sun_path holds 108 bytes with the terminating NUL (Linux's sockaddr_un).
SOCKET_PATH_MAX = 107


def load_config(source: Path | str | dict[str, Any], model: type[_M]) -> _M:
    """Validate a YAML file (path) or a mapping into ``model``; :class:`ConfigError` on
    any problem, one line each, naming the YAML path.

    A daemon file (with ``socket``, ``limits``, ... sections) also opens as a
    :class:`ChainConfig`: it is then validated, strictly, as the :class:`DaemonConfig`
    it is, which is a :class:`ChainConfig`."""
    data = source if isinstance(source, dict) else read_config_file(source)
    target: type[BaseModel] = model
    if issubclass(DaemonConfig, model) and data.keys() - model.model_fields.keys():
        target = DaemonConfig
    try:
        return cast(_M, target.model_validate(data))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, model=target)) from exc
