"""The S3 level checks at start that its server keeps objects write-once, and says what it
runs on (issue 61, item 3): a probe object under the level's ``key_prefix`` is created
twice with ``If-None-Match: *`` and deleted; the second create must be refused (412).

Two real S3 servers: SeaweedFS and moto's server (``tests/s3_kit.py``), both of which
refuse a second create. The servers that do not are made with the fault proxy: one that
ignores the condition (the proxy forwards a conditional PUT to moto without its
``If-None-Match``, so moto really overwrites: s3rver's behaviour) and one that refuses
conditional writes (``501 NotImplemented`` to a PUT carrying the header, as some servers
answer). With ``write_once: require`` (the default) the level refuses to start on
either, naming what the server did; with ``best_effort`` it runs and says so.

Also: a level whose every write is refused (403 to PUTs) opens its write breaker and is
unhealthy (``health()``, and ``tierd health`` through a real daemon in
``tests/test_s3_daemons.py``); a server absent at start is checked before the first write.
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import obstore
import pytest
from s3_kit import MotoServer, S3FaultProxy, SeaweedServer, fault_proxy

from tests.daemon_kit import Spawn
from tierd.chain import TierChain
from tierd.config import ChainConfig
from tierd.errors import ConfigError
from tierd.keys import BlockKey
from tierd.library import open_chain
from tierd.remote.s3_level import S3Level
from tierd.testing import daemon_config

BLOCK = 16 << 10
DEADLINE = 2.0  # generous: these tests assert answers on a busy machine
BACKOFF = 0.3


def block(key: bytes, salt: bytes = b"") -> bytes:
    return random.Random(key + salt).randbytes(BLOCK)


def names(prefix: str, count: int) -> list[BlockKey]:
    return [BlockKey(f"{prefix}-{i}".encode()) for i in range(count)]


class Bucket:
    """One test's prefix in a server's bucket, reached at ``endpoint`` (a proxy's, or the
    server's own), with the server's credentials (the secret in a private file)."""

    def __init__(self, server: SeaweedServer | MotoServer, root: Path) -> None:
        self.server = server
        self.prefix = f"w-{secrets.token_hex(4)}/"
        self.secret = root / "s3-secret"
        self.secret.write_text(server.secret_key + "\n")
        self.secret.chmod(0o600)

    def remote(self, endpoint: str | None = None, **overrides: Any) -> dict[str, Any]:
        return {
            "kind": "s3",
            "endpoint": endpoint or self.server.endpoint,
            "bucket": self.server.bucket,
            "key_prefix": self.prefix,
            "access_key_id": self.server.access_key,
            "secret_access_key_file": str(self.secret),
            "deadline": DEADLINE,
            "breaker_backoff": BACKOFF,
            **overrides,
        }

    async def objects(self) -> list[str]:
        listed = await obstore.list(self.server.store(), self.prefix).collect_async()
        return sorted(meta["path"] for meta in listed)

    async def body(self, path: str) -> bytes:
        return bytes(await (await obstore.get_async(self.server.store(), path)).bytes_async())


@pytest.fixture
def moto_proxy(moto: MotoServer) -> Iterator[S3FaultProxy]:
    """A fault proxy in front of the module's moto server."""
    with fault_proxy(moto.port) as proxy:
        yield proxy


@asynccontextmanager
async def node(remote: dict[str, Any]) -> AsyncIterator[TierChain]:
    """One node: a memory tier of 4 blocks, written through to the S3 level."""
    tier = {"name": "mem", "kind": "memory", "capacity": 4, "write_through": True}
    config = ChainConfig.model_validate({"block_bytes": BLOCK, "tiers": [tier], "remote": remote})
    async with asyncio.timeout(60), open_chain(config) as chain:
        yield chain


def level(chain: TierChain) -> S3Level:
    found = chain.remote.level if chain.remote is not None else None
    assert isinstance(found, S3Level), found
    return found


async def store_through(chain: TierChain, keys: list[BlockKey], salt: bytes = b"") -> None:
    await chain.store(keys, [block(k, salt) for k in keys])
    await level(chain).drain()


async def refused_at_start(remote: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as refused:
        async with node(remote):
            pass
    return str(refused.value)


# -- servers that keep objects write-once -------------------------------------------------


@pytest.mark.parametrize("kind", ["moto", "seaweedfs"])
async def test_a_server_that_refuses_a_second_create_runs_write_once(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    server = request.getfixturevalue("moto" if kind == "moto" else "seaweed")
    bucket = Bucket(server, tmp_path)
    keys = names("once", 3)
    async with node(bucket.remote()) as a:
        stats = level(a).stats()
        assert (stats["write_once"], stats["write_once_mode"]) == ("honoured", "require")
        assert level(a).health() == [{"name": "s3", "ok": True, "problems": [], "notes": []}]
        await store_through(a, keys)
        assert level(a).stats()["stores"] == len(keys)
        paths = sorted(level(a).path(k) for k in keys)
    assert await bucket.objects() == paths  # the probe object was deleted
    async with node(bucket.remote()) as b:  # other bytes under the same keys
        await store_through(b, keys, salt=b"other")
        stats = level(b).stats()
        assert (stats["stores"], stats["skipped"]) == (0, len(keys))
    for key, path in zip(keys, paths, strict=True):
        assert (await bucket.body(path)).endswith(block(key))  # the first node's bytes


# -- a server that ignores If-None-Match --------------------------------------------------


async def test_the_proxy_makes_moto_ignore_the_condition(
    moto: MotoServer, moto_proxy: S3FaultProxy, tmp_path: Path
) -> None:
    """What the next tests rely on: through the proxy, a second create overwrites."""
    moto_proxy.set_fault("ignore-condition", methods=["PUT"])
    store = moto.store(endpoint=moto_proxy.endpoint)
    path = f"{Bucket(moto, tmp_path).prefix}twice"
    await obstore.put_async(store, path, b"first", mode="create")
    await obstore.put_async(store, path, b"second", mode="create")  # no 412
    assert bytes(await (await obstore.get_async(moto.store(), path)).bytes_async()) == b"second"
    await obstore.delete_async(moto.store(), path)


async def test_a_server_that_ignores_the_condition_is_refused_at_start(
    moto: MotoServer, moto_proxy: S3FaultProxy, tmp_path: Path
) -> None:
    bucket = Bucket(moto, tmp_path)
    moto_proxy.set_fault("ignore-condition", methods=["PUT"])
    error = await refused_at_start(bucket.remote(moto_proxy.endpoint))
    assert error.startswith("remote.write_once: "), error
    assert "ignores If-None-Match" in error and "best_effort" in error, error
    assert moto_proxy.faulted["ignore-condition"] == 2  # the probe's two creates
    assert await bucket.objects() == []  # the probe object was deleted


async def test_best_effort_runs_on_a_server_that_ignores_the_condition_and_says_so(
    moto: MotoServer, moto_proxy: S3FaultProxy, tmp_path: Path
) -> None:
    bucket = Bucket(moto, tmp_path)
    moto_proxy.set_fault("ignore-condition", methods=["PUT"])
    keys = names("ignored", 2)
    async with node(bucket.remote(moto_proxy.endpoint, write_once="best_effort")) as chain:
        stats = level(chain).stats()
        assert (stats["write_once"], stats["write_once_mode"]) == ("ignored", "best_effort")
        [line] = level(chain).health()
        assert line["ok"] and line["problems"] == []
        assert "write-once ignored" in line["notes"][0], line
        await store_through(chain, keys)
        assert level(chain).stats()["stores"] == len(keys)
    assert len(await bucket.objects()) == len(keys)


# -- a server that refuses conditional writes ---------------------------------------------


async def test_a_server_that_refuses_conditional_writes_is_refused_at_start(
    seaweed: SeaweedServer, s3_proxy: S3FaultProxy, tmp_path: Path
) -> None:
    bucket = Bucket(seaweed, tmp_path)
    s3_proxy.set_fault("status:501", methods=["PUT"], header="if-none-match")
    error = await refused_at_start(bucket.remote(s3_proxy.endpoint))
    assert error.startswith("remote.write_once: "), error
    assert "refuses conditional writes" in error and "NotImplemented" in error, error
    assert s3_proxy.forwarded["PUT"] == 0  # nothing reached the bucket
    assert await bucket.objects() == []


async def test_best_effort_writes_plain_puts_where_the_condition_is_refused(
    seaweed: SeaweedServer, s3_proxy: S3FaultProxy, tmp_path: Path
) -> None:
    """The issue's second server: 0 of 64 blocks reached the bucket while health said
    ok. Now, in best effort, the blocks land (plain PUTs) and the level says how."""
    bucket = Bucket(seaweed, tmp_path)
    s3_proxy.set_fault("status:501", methods=["PUT"], header="if-none-match")
    keys = names("plain", 3)
    async with node(bucket.remote(s3_proxy.endpoint, write_once="best_effort")) as chain:
        assert level(chain).stats()["write_once"] == "rejected"
        await store_through(chain, keys)
        stats = level(chain).stats()
        assert (stats["stores"], stats["errors"], stats["dropped"]) == (len(keys), 0, 0), stats
        [line] = level(chain).health()
        assert line["ok"] and "write-once rejected" in line["notes"][0], line
    assert s3_proxy.faulted["status:501"] == 1  # the probe only: writes carry no condition
    assert len(await bucket.objects()) == len(keys)


# -- writes all refused; a server absent at start ----------------------------------------


async def test_a_level_whose_every_write_is_refused_opens_its_write_breaker(
    seaweed: SeaweedServer, s3_proxy: S3FaultProxy, tmp_path: Path
) -> None:
    bucket = Bucket(seaweed, tmp_path)
    keys = names("refused", 5)
    async with node(bucket.remote(s3_proxy.endpoint, breaker_backoff=1.5)) as chain:
        s3_proxy.set_fault("status:403", methods=["PUT"])
        for key in keys[:3]:  # breaker_failures write batches, each refused whole
            await store_through(chain, [key])
            # A read answered between them (a HEAD of a block nobody wrote) closes the
            # call breaker: on its own, it would never open for these writes.
            assert await level(chain).present(names("nobody", 1)) == [False]
        stats = level(chain).stats()
        assert (stats["write_state"], stats["write_breaker_opened"]) == ("open", 1), stats
        assert stats["state"] == "closed" and stats["stores"] == 0, stats
        [line] = level(chain).health()
        assert not line["ok"], line
        assert "writes refused: 3 write batches in a row landed no block" in line["problems"][0]
        puts = s3_proxy.requests["PUT"]
        await store_through(chain, keys[3:4])  # refused at once, not sent
        assert s3_proxy.requests["PUT"] == puts
        s3_proxy.set_fault(None)
        await asyncio.sleep(level(chain).calls.write_breaker.retry_in_s + 0.05)
        await store_through(chain, keys[4:])  # the probe write lands: closed again
        stats = level(chain).stats()
        assert (stats["write_state"], stats["stores"]) == ("closed", 1), stats
        assert level(chain).health()[0]["ok"]


async def test_a_server_absent_at_start_is_checked_before_the_first_write(
    seaweed: SeaweedServer, s3_proxy: S3FaultProxy, tmp_path: Path
) -> None:
    bucket = Bucket(seaweed, tmp_path)
    keys = names("late", 2)
    s3_proxy.set_fault("refuse")
    async with node(bucket.remote(s3_proxy.endpoint)) as chain:  # starts all the same
        assert level(chain).stats()["write_once"] == "unchecked"
        [line] = level(chain).health()
        assert not line["ok"] and "write-once not checked yet" in line["problems"][-1], line
        await store_through(chain, keys[:1])  # held back: nothing is known of the server
        assert (level(chain).stats()["stores"], level(chain).stats()["dropped"]) == (0, 1)
        s3_proxy.set_fault(None)
        await asyncio.sleep(BACKOFF + 0.05)
        await store_through(chain, keys[1:])  # checked first, then written
        stats = level(chain).stats()
        assert (stats["write_once"], stats["stores"]) == ("honoured", 1), stats
        assert level(chain).health()[0]["ok"]
    assert await bucket.objects() == [level(chain).path(keys[1])]


# -- through a real daemon ----------------------------------------------------------------


async def test_a_daemon_refuses_to_start_on_a_server_that_ignores_the_condition(
    moto: MotoServer, moto_proxy: S3FaultProxy, tmp_path: Path, spawn: Spawn
) -> None:
    bucket = Bucket(moto, tmp_path)
    moto_proxy.set_fault("ignore-condition", methods=["PUT"])
    home = tmp_path / "a"
    home.mkdir(mode=0o700)
    config = daemon_config(home, cpu_blocks=8, disk_blocks=16, block_bytes=BLOCK)
    config["remote"] = bucket.remote(moto_proxy.endpoint)
    daemon = await spawn(config, ready=False)
    status = await daemon.wait()
    err = daemon.stderr()
    assert status == 78, err
    assert "Traceback" not in err
    assert "remote.write_once" in err and "ignores If-None-Match" in err, err
