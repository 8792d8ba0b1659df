"""The config of the levels beyond the node: the Redis-protocol level
(:class:`RemoteConfig`) and the S3 level (:class:`S3Config`), one shape for both
(:class:`RemoteCommon`), chained with ``below:``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from tierd.config.base import AdmissionRule, Seconds, Size, StrictModel, errors_at
from tierd.configfile import expand_path

__all__ = ["RemoteCommon", "RemoteConfig", "RemoteSpec", "S3Config", "remote_kind"]


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
    # A server that does not keep objects write-once (found at start: docs/remote.md):
    # "require" refuses to start, "best_effort" runs and says so.
    write_once: Literal["require", "best_effort"] = "require"

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

# ``below`` names the two models defined after the base: resolve them now, once, rather
# than at whichever first use happens to come.
RemoteConfig.model_rebuild()
S3Config.model_rebuild()
