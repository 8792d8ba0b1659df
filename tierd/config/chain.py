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
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tierd.config.base import (
    AdmissionRule,
    BlockSize,
    Seconds,
    Size,
    StrictModel,
    error_at,
    errors_at,
)
from tierd.config.remote import RemoteSpec, remote_kind
from tierd.configfile import expand_path
from tierd.errors import ConfigError
from tierd.keys import Medium
from tierd.policy import policy_names
from tierd.units import MAX_BLOCKS, capacity_parts, parse_size

__all__ = [
    "MAX_BLOCK_BYTES",
    "ChainConfig",
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
    # copy each block a client stores here down to the next tier in the background, so
    # that its eviction later is a drop, not a demotion the next store waits for
    write_behind: bool = False
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
        if self.write_behind and self.write_through:
            raise error_at("write_behind", "write_through copies every block down at once already")
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
        if self.tiers and self.tiers[-1].write_behind:
            path = f"tiers.{len(self.tiers) - 1}.write_behind"
            problems.append((path, "the last tier has no tier below to copy its blocks to"))
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
