"""Tenants: who may use the daemon, and how its tiers are divided among them.

A tenant is a set of peers named by the kernel (``SO_PEERCRED``: a uid, or a primary
gid), never by what a client says. Each tenant gets tiers of its own: a quota of every
configured tier (blocks, a size, or a share like ``"25%"``), a shared-memory pool of its
own that only its clients are handed (as a file descriptor), a disk slab of its own in a
subdirectory named after it. One tenant's stores therefore never evict another's blocks,
and no client can map, read or write another tenant's memory. Namespaces stay labels
inside a tenant, limited to its ``namespaces`` patterns (shell-style: ``llama-*``).

A tier's quotas may not add up to more than its capacity. A tenant that gives no quota
for a tier gets an equal share of what the others' quotas leave; every tenant must end
up with at least one block of every tier.

Without a ``tenants:`` section there is one tenant, ``default``, with the whole of every
tier: the daemon's own uid is its operator, and ``socket.allow_uids``/``allow_gids``
admit other peers into it (sharing its pool, as members, not operators).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tierd.units import capacity_parts, share_parts

__all__ = ["DEFAULT_TENANT", "QuotaProblem", "TenantConfig", "quota_blocks"]

DEFAULT_TENANT = "default"
_MAX_ID = (1 << 32) - 2  # (uid_t)-1 means "no id"


class TenantConfig(BaseModel):
    """One tenant: its peers, its namespaces, its quota of each tier, its role."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    uids: list[int] = Field(default_factory=list)
    gids: list[int] = Field(default_factory=list)
    namespaces: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    quota: dict[str, int | str] = Field(default_factory=dict)
    operator: bool = False  # may clear, flush, stop, read the config and every tenant's stats

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        # The name is a directory of every disk tier: "." is the untenanted slab's own
        # directory and ".." the one above it.
        if value in (".", ".."):
            raise ValueError(f"{value!r} is not a tenant name (it names a directory)")
        return value

    @field_validator("uids", "gids")
    @classmethod
    def _ids(cls, value: list[int]) -> list[int]:
        for item in value:
            if isinstance(item, bool) or not 0 <= item <= _MAX_ID:
                raise ValueError(f"{item!r} is not a uid or gid (0 to {_MAX_ID})")
        return value

    @field_validator("namespaces")
    @classmethod
    def _patterns(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if not 0 < len(pattern) <= 256:
                raise ValueError("a namespace pattern has 1 to 256 characters")
        return value

    @field_validator("quota")
    @classmethod
    def _quota(cls, value: dict[str, int | str]) -> dict[str, int | str]:
        for amount in value.values():
            _quota_parts(amount)
        return value


@dataclass(frozen=True, slots=True)
class QuotaProblem(Exception):
    """A quota that cannot be met; ``path`` is where in the config it is."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def _quota_parts(value: int | str) -> tuple[float, str]:
    """``(amount, unit)`` with unit ``share``, ``blocks`` or ``bytes``."""
    if isinstance(value, str) and value.strip().endswith("%"):
        return share_parts(value)[0], "share"  # raises for a share past 100 %
    count, is_bytes = capacity_parts(value)  # raises for what is neither
    return float(count), "bytes" if is_bytes else "blocks"


def quota_blocks(
    tenants: Sequence[TenantConfig], tiers: Sequence[tuple[str, int]], block_bytes: int
) -> dict[str, dict[str, int]]:
    """Blocks of each tier (``tiers``: name and capacity in blocks) for each tenant, by
    tenant name then tier name; :class:`QuotaProblem` when they do not fit."""
    names = {name for name, _ in tiers}
    for index, tenant in enumerate(tenants):
        for tier in tenant.quota:
            if tier not in names:
                known = ", ".join(sorted(names))
                raise QuotaProblem(
                    f"tenants.{index}.quota.{tier}", f"no tier named {tier!r} ({known})"
                )
    out: dict[str, dict[str, int]] = {tenant.name: {} for tenant in tenants}
    for tier, capacity in tiers:
        given = 0
        rest: list[int] = []
        for index, tenant in enumerate(tenants):
            if tier not in tenant.quota:
                rest.append(index)
                continue
            amount, unit = _quota_parts(tenant.quota[tier])
            blocks = {
                "share": int(amount * capacity),
                "blocks": int(amount),
                "bytes": int(amount) // block_bytes,
            }[unit]
            if blocks < 1:
                raise QuotaProblem(
                    f"tenants.{index}.quota.{tier}",
                    f"{tenant.quota[tier]!r} holds no block of {block_bytes} bytes",
                )
            out[tenant.name][tier] = blocks
            given += blocks
        if given > capacity:
            raise QuotaProblem(
                f"tenants.*.quota.{tier}",
                f"the quotas add up to {given:,} blocks, more than the tier's {capacity:,}",
            )
        if rest:
            each = (capacity - given) // len(rest)
            if each < 1:
                first = tenants[rest[0]].name
                raise QuotaProblem(
                    f"tenants.{rest[0]}.quota",
                    f"nothing of tier {tier!r} is left for tenant {first!r}: give it a quota"
                    " there, or lower the others'",
                )
            for index in rest:
                out[tenants[index].name][tier] = each
    return out
