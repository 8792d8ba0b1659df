"""The ``kv_events:`` section: KV-cache events for routers (docs/events.md), off by default.

Events reveal the token ids of what each tenant stored: the operator names which tenants'
blocks are published (``tenants``; ``["*"]``: all) and where (``endpoint``, loopback by
default; any other address must be written out, never a wildcard).
"""

from __future__ import annotations

import ipaddress
import re

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
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = "tcp://127.0.0.1:5558"
    topic: str = Field(default="", max_length=256)  # e.g. kv@node:<node>@<model>
    tenants: list[str] = Field(default_factory=lambda: ["*"])
    media: dict[str, str] = Field(default_factory=lambda: dict(_DEFAULT_MEDIA))
    locality: str | None = "LOCAL"
    ownership: str | None = Field(default=None, max_length=128)  # a cache-owner identity
    data_parallel_rank: int | None = Field(default=None, ge=0)
    batch_s: Seconds = Field(default=0.01, gt=0, le=10)
    max_batch_events: int = Field(default=1024, ge=1, le=1 << 16)
    queue_batches: int = Field(default=1024, ge=1, le=1 << 20)
    buffer_batches: int = Field(default=10_000, ge=1, le=1 << 22)
    hwm: int = Field(default=100_000, ge=1)
    descriptor_bytes: Size = Field(default=256 << 20, ge=1 << 16)  # per tenant

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        return _check_endpoint(value)

    @field_validator("replay_endpoint")
    @classmethod
    def _replay(cls, value: str | None) -> str | None:
        return None if value is None else _check_endpoint(value)

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
