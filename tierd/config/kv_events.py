"""The ``kv_events:`` section: KV-cache events for routers (docs/events.md), off by default.

Events reveal the token ids of what each tenant stored (its prompts): the operator names
which tenants' blocks are published (``tenants``; ``["*"]``: all) and who reads them. By
default each tenant has a stream of its own, on ipc sockets in ``directory`` that only the
daemon's user may connect to (``readers`` gives a tenant's to a group as well). An
``endpoint`` puts one tenant's stream where the operator says; a tcp:// one is open to
every local user (and to any host that reaches it), so it is taken only with
``anyone_may_read: true``, and its address is written out, never a wildcard.
"""

from __future__ import annotations

import grp
import ipaddress
import re
from pathlib import Path

from pydantic import Field, field_validator

from tierd.config.base import Seconds, Size, StrictModel

__all__ = ["ENGINE_MEDIA", "KvEventsConfig"]

# The media as the engines name them (vLLM: GPU, CPU; SGLang: CPU_PINNED; both: DISK;
# EXTERNAL for a level shared across nodes, STORAGE for vLLM's secondary tiers).
ENGINE_MEDIA = frozenset({"GPU", "CPU", "CPU_PINNED", "DISK", "STORAGE", "EXTERNAL"})
_DEFAULT_MEDIA = {
    "GPU": "GPU",
    "CPU": "CPU",
    "MEMORY": "CPU",
    "DISK": "DISK",
    "REMOTE": "EXTERNAL",
    "OBJECT": "EXTERNAL",
}
_SUN_PATH = 107  # the longest path a Unix socket binds to
_OPEN_TO_ALL = (
    "a tcp:// endpoint lets every local user (and any host that reaches it) read the"
    " token ids of what the tenant stores, its prompts: leave endpoint out (each tenant's"
    " own ipc sockets, for the daemon's user and kv_events.readers) or set"
    " kv_events.anyone_may_read: true"
)
_TCP = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):(\d{1,5})$")


def _check_endpoint(value: str) -> str:
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return value
    match = _TCP.match(value)
    if match is None:
        raise ValueError(f"{value!r} is not tcp://HOST:PORT or ipc://PATH")
    host = match.group(1).strip("[]")
    if host in ("*", "0.0.0.0", "::"):
        raise ValueError("a wildcard address publishes to every network: name one address")
    if int(match.group(2)) > 65535:
        raise ValueError(f"port {match.group(2)} is out of range")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IP address (or localhost)") from None
    return value


class KvEventsConfig(StrictModel):
    """ZMQ PUB of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` in vLLM's wire
    format, a ROUTER for replays, and the book of block descriptions they come from."""

    enabled: bool = False
    # None: each published tenant's stream on ipc sockets in ``directory`` (and a replay
    # socket beside it); set: the one published tenant's stream there.
    endpoint: str | None = None
    replay_endpoint: str | None = None  # with ``endpoint`` only; None: no replay
    directory: Path | None = None  # None: "events" beside the control socket
    readers: dict[str, int | str] = Field(default_factory=dict)  # tenant -> a group (or gid)
    anyone_may_read: bool = False  # the opt-in a tcp:// endpoint needs
    topic: str = Field(default="", max_length=256)  # e.g. kv@node:<node>@<model>
    tenants: list[str] = Field(default_factory=lambda: ["*"])
    media: dict[str, str] = Field(default_factory=lambda: dict(_DEFAULT_MEDIA))
    locality: str | None = "LOCAL"
    # Dropped: no router credits a node by an owner identity (docs/events.md, "Identity").
    ownership: None = None
    data_parallel_rank: int | None = Field(default=None, ge=0)
    batch_s: Seconds = Field(default=0.005, gt=0, le=10)
    max_batch_events: int = Field(default=1024, ge=1, le=1 << 16)
    queue_batches: int = Field(default=1024, ge=1, le=1 << 20)
    buffer_batches: int = Field(default=10_000, ge=1, le=1 << 22)
    hwm: int = Field(default=1000, ge=1)
    buffer_bytes: Size = Field(default=64 << 20, ge=1 << 16)
    max_peers: int = Field(default=64, ge=1, le=4096)  # connections to each events socket
    descriptor_bytes: Size = Field(default=256 << 20, ge=1 << 16)  # per tenant

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        return None if value is None else _check_endpoint(value)

    @field_validator("ownership", mode="before")
    @classmethod
    def _ownership(cls, value: object) -> None:
        if value is not None:
            raise ValueError(
                "an owner identity is no longer published: no router credits a node by one"
                " (Dynamo's indexer kept such events and listed the node in no answer); a"
                " router credits tierd's blocks through its own stream (docs/events.md)"
            )
        return None

    @field_validator("readers")
    @classmethod
    def _readers(cls, value: dict[str, int | str]) -> dict[str, int | str]:
        for tenant, group in value.items():
            if isinstance(group, str):
                try:
                    grp.getgrnam(group)
                except KeyError:
                    raise ValueError(f"{tenant}: no group named {group!r}") from None
            elif group < 0:
                raise ValueError(f"{tenant}: {group} is not a group id")
        return value

    def reader_gid(self, tenant: str) -> int | None:
        """The group that may read ``tenant``'s own stream besides the daemon's user."""
        group = self.readers.get(tenant)
        return grp.getgrnam(group).gr_gid if isinstance(group, str) else group

    def problems(self, published: list[str], socket_dir: Path) -> list[tuple[str, str]]:
        """What is wrong with this section given the tenants it publishes and the control
        socket's directory (the default home of the per-tenant sockets)."""
        if not self.enabled:
            return []
        problems: list[tuple[str, str]] = []
        for field, value in (
            ("endpoint", self.endpoint),
            ("replay_endpoint", self.replay_endpoint),
        ):
            if value is not None and value.startswith("tcp://") and not self.anyone_may_read:
                problems.append((f"kv_events.{field}", _OPEN_TO_ALL))
        if self.endpoint is None:
            if self.replay_endpoint is not None:
                problems.append(
                    (
                        "kv_events.replay_endpoint",
                        "goes with endpoint; without"
                        " one, each tenant's replay socket is beside its stream's",
                    )
                )
            directory = self.directory or socket_dir / "events"
            for tenant in published:
                longest = f"{directory}/{tenant}/replay"
                if len(longest.encode()) > _SUN_PATH:
                    problems.append(
                        (
                            "kv_events.directory",
                            f"{longest!r} is longer than a"
                            f" socket path may be ({_SUN_PATH} bytes): choose a shorter one",
                        )
                    )
                    break
        else:
            if len(published) > 1:
                problems.append(
                    (
                        "kv_events.endpoint",
                        "carries one tenant's events, and"
                        f" {len(published)} are published: leave endpoint out (each"
                        " tenant's own sockets), or name one tenant in kv_events.tenants",
                    )
                )
            if self.readers:
                problems.append(
                    (
                        "kv_events.readers",
                        "names who reads a tenant's own"
                        " sockets: with an endpoint, its address says who reads",
                    )
                )
        problems += [
            ("kv_events.readers", f"{name!r} is not a published tenant")
            for name in self.readers
            if name not in published
        ]
        return problems

    @field_validator("media")
    @classmethod
    def _media(cls, value: dict[str, str]) -> dict[str, str]:
        media = dict(_DEFAULT_MEDIA)
        for ours, theirs in value.items():
            if ours not in _DEFAULT_MEDIA:
                raise ValueError(f"{ours!r} is not a tier medium ({', '.join(_DEFAULT_MEDIA)})")
            if theirs not in ENGINE_MEDIA:
                known = ", ".join(sorted(ENGINE_MEDIA))
                raise ValueError(f"{theirs!r} is not a medium the engines name ({known})")
            media[ours] = theirs
        return media

    @field_validator("locality")
    @classmethod
    def _locality(cls, value: str | None) -> str | None:
        if value not in (None, "LOCAL", "REMOTE"):
            raise ValueError("locality is LOCAL, REMOTE or null")
        return value

    def publishes(self, tenant: str) -> bool:
        return self.enabled and ("*" in self.tenants or tenant in self.tenants)
