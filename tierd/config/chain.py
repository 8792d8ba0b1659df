"""The chain's config: block size, the tiers fastest first, where stores enter, copy
budgets and the shared remote level.

:class:`ChainConfig` is what the library opens (:func:`tierd.open`) and what each of the
daemon's tenants gets a part of; :class:`TierConfig` is one tier, :class:`RemoteConfig`
the Redis-protocol level below the last one, :class:`S3Config` an object-store level
(alone, or below the Redis level). A tier's ``capacity`` is a number of blocks
(``4096`` or ``"4096 blocks"``) or a size (``"64GiB"``, divided by ``block_bytes``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from tierd.config.base import BlockSize, Seconds, Size, StrictModel, error_at, errors_at
from tierd.configfile import expand_path
from tierd.errors import ConfigError
from tierd.keys import Medium
from tierd.policy import policy_names
from tierd.policy.admission import Admission
from tierd.units import MAX_BLOCKS, capacity_parts, parse_size


def _admission_rule(value: str) -> str:
    Admission.parse(value)  # raises ValueError naming what is allowed
    return value


# A level's admission rule (``always``, ``reuse>=2``, ``comeback>=0.1|sample<=0.5``, ...).
AdmissionRule = Annotated[str, AfterValidator(_admission_rule)]

__all__ = [
    "MAX_BLOCK_BYTES",
    "ChainConfig",
    "RemoteConfig",
    "S3Config",
    "TierConfig",
    "TierKind",
    "TransferConfig",
    "chain_rules",
    "raw_chain_problems",
]


class TierKind(StrEnum):
    MEMORY = "memory"
    CPU = "cpu"
    GPU = "gpu"
    DISK = "disk"

    @property
    def medium(self) -> Medium:
        return Medium(self.value.upper())


class TierConfig(StrictModel):
    """One level of the chain."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    kind: TierKind
    capacity: int | str = Field(description="blocks (4096, '4096 blocks') or bytes ('64GiB')")
    policy: str = "lru"
    write_through: bool = False
    admission: AdmissionRule = "always"
    device: str | None = None  # gpu: "cuda:0" (or "cpu" for development)
    # disk: one slab file each; "~", "$VAR" and "${VAR:-default}" are expanded
    directories: list[Path] = Field(default_factory=list)
    o_direct: bool | str = "auto"  # disk: true, false or "auto" (probe)
    # disk, at a restart: up to this many kept blocks are adopted before the tier serves;
    # more are adopted in the background, at most ``adopt_rate`` per second (0: no bound)
    adopt_inline: int = Field(default=65536, ge=0)
    adopt_rate: int = Field(default=0, ge=0)
    # disk: when writes are synced (docs/config.md says what a crash loses in each mode):
    # "always" before each write is acknowledged, "batch" at most fsync_interval after
    # it, "none" never while serving
    fsync: Literal["always", "batch", "none"] = "always"
    fsync_interval: Seconds = Field(default=1.0, gt=0, le=3600)
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
            raise error_at("directories", "a disk tier needs at least one directory")
        if self.kind is not TierKind.DISK and self.directories:
            raise error_at("directories", f"only applies to disk tiers, not {self.kind}")
        changed = self.fsync != "always" or self.fsync_interval != 1.0  # not the defaults
        if self.kind is not TierKind.DISK and changed:
            what = "fsync" if self.fsync != "always" else "fsync_interval"
            raise error_at(what, f"only applies to disk tiers, not {self.kind}")
        if self.kind is TierKind.GPU and self.device is None:
            raise error_at("device", "a gpu tier needs a device ('cuda:0', or 'cpu' to test)")
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


class RemoteCommon(StrictModel):
    """What every remote level is configured with, whatever its server: one shape for
    the Redis level and the S3 level. ``below`` chains another level under this one
    (say S3 under Redis): blocks are written to both, found in the upper one first, and
    promoted up from the lower one (docs/remote.md)."""

    name: str = Field(default="remote", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    key_prefix: str = Field(default="tierd:", max_length=256)
    pool_size: int = Field(default=16, ge=1, le=1024)
    deadline: Seconds = Field(default=0.1, gt=0, le=60)  # per call
    admission: AdmissionRule = "always"
    max_pending_writes: Size = Field(default=64 << 20, ge=0)  # bytes queued to write
    breaker_failures: int = Field(default=3, ge=1)
    breaker_backoff: Seconds = Field(default=0.5, gt=0)
    breaker_max_backoff: Seconds = Field(default=30.0, gt=0)
    below: Annotated[RemoteConfig | S3Config, Field(discriminator="kind")] | None = None

    @field_validator("below", mode="before")
    @classmethod
    def _below(cls, value: Any) -> Any:
        return remote_kind(value)

    def _common_problems(self) -> list[tuple[str, str]]:
        problems = []
        if self.breaker_max_backoff < self.breaker_backoff:
            problems.append(("breaker_max_backoff", "must be at least breaker_backoff"))
        if self.below is not None and self.below.admission != "always":
            message = "admission applies to blocks leaving the node: set it on the first level"
            problems.append(("below.admission", message))
        return problems

    def levels(self) -> list[RemoteConfig | S3Config]:
        """This level and every level below it, fastest first."""
        out: list[RemoteConfig | S3Config] = []
        level: RemoteConfig | S3Config | None = self  # type: ignore[assignment]
        while level is not None:
            out.append(level)
            level = level.below
        return out

    def with_prefix(self, suffix: str) -> RemoteConfig | S3Config:
        """A copy whose levels keep their objects under ``key_prefix + suffix``."""
        below = None if self.below is None else self.below.with_prefix(suffix)
        update = {"key_prefix": f"{self.key_prefix}{suffix}", "below": below}
        return self.model_copy(update=update)  # type: ignore[return-value]


def remote_kind(value: Any) -> Any:
    """A level's mapping with the default kind (``redis``) filled in, so that the
    discriminated union can pick its model."""
    if isinstance(value, dict) and "kind" not in value:
        return {**value, "kind": "redis"}
    return value


class RemoteConfig(RemoteCommon):
    """The shared level on a Redis-protocol server or cluster.

    The server owns eviction (``maxmemory`` with ``allkeys-lru`` or ``allkeys-lfu``), so
    the remote level has no capacity here and the daemon keeps no index of it."""

    kind: Literal["redis"] = "redis"
    url: str | None = None  # redis://host:port/db, rediss://..., unix:///path?db=0
    cluster_nodes: list[str] | None = None  # "host:port" seeds of a cluster
    ttl: Seconds = Field(default=0.0, ge=0)  # 0: keys never expire (the server evicts)

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
        problems = self._common_problems()
        if (self.url is None) == (not self.cluster_nodes):
            problems.append(("url", "give exactly one of url and cluster_nodes"))
        if problems:
            raise errors_at(problems)
        return self


_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class S3Config(RemoteCommon):
    """The object-store level on an S3-compatible server (AWS S3, SeaweedFS, MinIO, ...).

    Objects are written once and never evicted by tierd: the bucket's lifecycle rules
    bound it (docs/remote.md). Credentials: ``access_key_id`` with the secret read from
    ``secret_access_key_file``, or else the environment (``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``)."""

    kind: Literal["s3"]
    name: str = Field(default="s3", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    endpoint: str | None = None  # http(s)://host:port; none: AWS's endpoint of the region
    bucket: str
    region: str = Field(default="us-east-1", pattern=r"^[a-z0-9-]{1,32}$")
    key_prefix: str = Field(default="tierd/", max_length=256)
    pool_size: int = Field(default=32, ge=1, le=1024)  # requests on the wire at once
    deadline: Seconds = Field(default=0.5, gt=0, le=60)  # per batch of requests
    access_key_id: str | None = Field(default=None, max_length=256)
    secret_access_key_file: Path | None = None

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/?#@\s]+/?$", value):
            raise ValueError(f"endpoint must be http(s)://host[:port], got {value!r}")
        return None if value is None else value.rstrip("/")

    @field_validator("bucket")
    @classmethod
    def _bucket(cls, value: str) -> str:
        if not _BUCKET.match(value) or ".." in value:
            raise ValueError(f"not an S3 bucket name (3-63 of a-z 0-9 . -): {value!r}")
        return value

    @field_validator("secret_access_key_file", mode="before")
    @classmethod
    def _expand(cls, value: Any) -> Any:
        return expand_path(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> S3Config:
        problems = self._common_problems()
        if (self.access_key_id is None) != (self.secret_access_key_file is None):
            message = "give both access_key_id and secret_access_key_file, or neither"
            problems.append(("access_key_id", message))
        if problems:
            raise errors_at(problems)
        return self


RemoteSpec = Annotated[RemoteConfig | S3Config, Field(discriminator="kind")]


class TransferConfig(StrictModel):
    budget_per_route: Size = 256 << 20


class ChainConfig(StrictModel):
    """The chain: block size, levels fastest first, and where stores enter."""

    block_bytes: BlockSize = 2 << 20
    tiers: list[TierConfig] = Field(min_length=1)
    entry: str | None = None  # tier name; default: the first tier
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    remote: RemoteSpec | None = None  # a shared level below the last tier

    @field_validator("remote", mode="before")
    @classmethod
    def _remote(cls, value: Any) -> Any:
        return None if value in ({}, None) else remote_kind(value)

    @model_validator(mode="after")
    def _check(self) -> ChainConfig:
        tiers = [(index, t.name, t.capacity) for index, t in enumerate(self.tiers)]
        remote = [] if self.remote is None else [level.name for level in self.remote.levels()]
        problems = chain_rules(self.block_bytes, tiers, self.entry, remote)
        if problems:
            raise errors_at(problems)
        return self

    @property
    def entry_index(self) -> int:
        names = [t.name for t in self.tiers]
        return 0 if self.entry is None else names.index(self.entry)


MAX_BLOCK_BYTES = 1 << 30


def chain_rules(
    block_bytes: int | None,
    tiers: Sequence[tuple[int, object, object]],
    entry: object,
    remote: object,
) -> list[tuple[str, str]]:
    """Every ``(path, message)`` the chain's cross-field rules find: block size, unique
    tier names, the entry and remote names, each capacity against the block size.
    ``tiers``: ``(index, name, capacity)``. Values that are ``None`` (or not parsed yet)
    are skipped, so :func:`raw_chain_problems` can run the same rules on a file whose
    fields did not all validate."""
    problems: list[tuple[str, str]] = []
    if block_bytes is not None and not 0 < block_bytes <= MAX_BLOCK_BYTES:
        message = f"must be between 1 byte and 1GiB ({MAX_BLOCK_BYTES:,} bytes)"
        problems.append(("block_bytes", message))
    names = [name for _, name, _ in tiers if isinstance(name, str)]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        problems.append(("tiers", f"tier names must be unique: {', '.join(twice)} named twice"))
    remotes = [remote] if isinstance(remote, str) else remote if isinstance(remote, list) else []
    for depth, name in enumerate(remotes):
        path = "remote" + ".below" * depth + ".name"
        if name in names:
            problems.append((path, f"{name!r} is also a tier's name"))
        elif name in remotes[:depth]:
            problems.append((path, f"{name!r} names two remote levels"))
    if isinstance(entry, str) and entry not in names:
        known = ", ".join(dict.fromkeys(names))
        problems.append(("entry", f"{entry!r} is not a tier name ({known})"))
    for index, _, capacity in tiers:
        problems += _capacity_rules(index, capacity, block_bytes)
    return problems


def _capacity_rules(index: int, capacity: object, block_bytes: int | None) -> list[tuple[str, str]]:
    if block_bytes is None or not 0 < block_bytes <= MAX_BLOCK_BYTES:
        return []
    if not isinstance(capacity, int | str):
        return []
    try:
        count, is_bytes = capacity_parts(capacity)
    except ValueError:  # the field's own check reports it
        return []
    if is_bytes and count < block_bytes:
        return [(f"tiers.{index}.capacity", f"{capacity!r} holds no block of {block_bytes} bytes")]
    if is_bytes and count // block_bytes > MAX_BLOCKS:
        message = f"{capacity!r} is more than {MAX_BLOCKS:,} blocks (2**40)"
        return [(f"tiers.{index}.capacity", message)]
    return []


def raw_chain_problems(data: Mapping[str, Any]) -> list[tuple[str, str]]:
    """:func:`chain_rules` on a file's raw mapping, for a file whose fields did not all
    validate (the model's own check then never ran): each value is used only where it
    reads as the model would read it."""
    tiers = data.get("tiers")
    rows = [
        (index, tier.get("name"), tier.get("capacity"))
        for index, tier in enumerate(tiers if isinstance(tiers, list) else [])
        if isinstance(tier, dict)
    ]
    try:
        block_bytes: int | None = parse_size(data.get("block_bytes", 2 << 20))
    except ValueError:
        block_bytes = None
    names = []
    remote = data.get("remote")
    while isinstance(remote, dict):
        default = "s3" if remote.get("kind") == "s3" else "remote"
        names.append(remote.get("name", default))
        remote = remote.get("below")
    return chain_rules(block_bytes, rows, data.get("entry"), names)


_SHM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_DEVICE = re.compile(r"^(cpu|cuda(:[0-9]{1,3})?)$")
