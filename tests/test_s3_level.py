"""The object-store level (``remote: {kind: s3}``) on a real S3 server (SeaweedFS), in
process: blocks that leave one node's chain are found and loaded byte-exact by another,
written once however many nodes send them; an object that is not intact is a counted
miss and is deleted; every fault of the server (through ``S3FaultProxy``) is a miss
bounded by the deadline, never an exception and never a stall of the event loop, and
the breaker stops asking a failing server until it answers again; under a Redis level
(``below:``) the two are written together, found top first and promoted up.

One SeaweedFS per module (``tests/s3_kit.py``); each test keeps to its own key prefix.
The config checks at the end need no server.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import obstore
import pytest
import yaml
from redis_kit import RedisServer, redis_server
from s3_kit import S3FaultProxy, SeaweedServer

from tests.chain_kit import assert_found_below, load_bytes
from tierd.chain import TierChain
from tierd.cli import main
from tierd.config import ChainConfig
from tierd.errors import BlockMissing
from tierd.keys import BlockKey, Medium
from tierd.library import open_chain
from tierd.remote import encode_block
from tierd.remote.s3_level import S3Level
from tierd.remote.stack import RemoteStack

BLOCK = 16 << 10
DEADLINE = 0.5  # where the server hangs: a short wait, then misses
GENEROUS = 2.0  # where a test asserts answers (hits, or counted faults) on a busy machine


def guard(deadline: float) -> float:
    """A bound against hanging for a call of ``deadline``, not a timing goal."""
    return deadline * 4 + 1


def block(key: bytes) -> bytes:
    return random.Random(key).randbytes(BLOCK)


def names(prefix: str, count: int) -> list[BlockKey]:
    return [BlockKey(f"{prefix}-{i}".encode()) for i in range(count)]


@dataclass(frozen=True, slots=True)
class Bucket:
    """Where a test's objects go: the module's server, the secret file, a fresh prefix."""

    server: SeaweedServer
    secret_file: Path
    prefix: str

    def remote(self, **overrides: Any) -> dict[str, Any]:
        """The chain's ``remote:`` section for this bucket (``overrides`` win)."""
        return {
            "kind": "s3",
            "endpoint": self.server.endpoint,
            "bucket": self.server.bucket,
            "key_prefix": self.prefix,
            "access_key_id": self.server.access_key,
            "secret_access_key_file": str(self.secret_file),
            "deadline": GENEROUS,
            "breaker_backoff": 0.3,
            **overrides,
        }

    def store(self, bucket: str | None = None) -> Any:
        """A direct client of the bucket, past any proxy."""
        return self.server.store(bucket)

    async def objects(self) -> list[str]:
        """The names of every object under this test's prefix."""
        listed = await obstore.list(self.store(), self.prefix).collect_async()
        return sorted(meta["path"] for meta in listed)


@pytest.fixture(scope="module")
def secret_file(seaweed: SeaweedServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "s3-secret"
    path.write_text(seaweed.secret_key + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def bucket(seaweed: SeaweedServer, secret_file: Path) -> Bucket:
    return Bucket(seaweed, secret_file, f"t-{secrets.token_hex(4)}/")


def config(
    remote: dict[str, Any],
    *,
    blocks: int = 4,
    write_through: bool = False,
    block_bytes: int = BLOCK,
) -> ChainConfig:
    tier = {"name": "mem", "kind": "memory", "capacity": blocks, "write_through": write_through}
    return ChainConfig.model_validate(
        {"block_bytes": block_bytes, "tiers": [tier], "remote": remote}
    )


@asynccontextmanager
async def node(remote: dict[str, Any], **kw: Any) -> AsyncIterator[TierChain]:
    """One node's chain: a small memory tier over the shared remote level(s)."""
    async with open_chain(config(remote, **kw)) as chain:
        yield chain


def level(chain: TierChain) -> S3Level:
    found = chain.remote.level if chain.remote is not None else None
    if not isinstance(found, S3Level):
        raise TypeError(f"the chain's remote level is {found!r}, not an S3Level")
    return found


def stack(chain: TierChain) -> RemoteStack:
    found = chain.remote.level if chain.remote is not None else None
    if not isinstance(found, RemoteStack):
        raise TypeError(f"the chain's remote level is {found!r}, not a RemoteStack")
    return found


async def store_through(chain: TierChain, keys: list[BlockKey]) -> None:
    """Store ``keys`` and wait until every write to the remote level is done."""
    await chain.store(keys, [block(k) for k in keys])
    if chain.remote is not None:
        await chain.remote.level.drain()


# -- one server ---------------------------------------------------------------------------


async def test_a_block_evicted_on_one_node_is_a_hit_on_another(bucket: Bucket) -> None:
    keys = names("shared", 8)
    async with node(bucket.remote()) as a:
        await store_through(a, keys[:4])
        await store_through(a, keys[4:])  # evicts the first four: sent to the bucket
        assert a.remote is not None and a.remote.sent == 4
        assert level(a).stats()["stores"] == 4
        paths = sorted(level(a).path(k) for k in keys[:4])
    assert await bucket.objects() == paths
    async with node(bucket.remote()) as b:
        await assert_found_below(b, keys, Medium.OBJECT, [block(k) for k in keys[:4]])
        stats = level(b).stats()
        assert stats["medium"] == "OBJECT"
        assert (stats["hits"], stats["corrupt"], stats["errors"]) == (4, 0, 0)
        # B sends the same blocks down: the bucket holds them (412), nothing is rewritten.
        await b.flush()
        stats = level(b).stats()
        assert (stats["stores"], stats["skipped"]) == (0, 4)
    assert await bucket.objects() == paths


async def test_tenants_of_one_bucket_never_see_each_others_blocks(bucket: Bucket) -> None:
    """Each tenant's chain keeps its objects under ``<key_prefix><tenant>:``: the same
    key stored by tenant a is no hit for tenant b, and b's own copy is a separate object."""
    from tierd.config.daemon import tenant_chain

    keys = names("tenant", 2)
    shared = config(bucket.remote(), write_through=True)

    def chain_of(tenant: str) -> ChainConfig:
        return tenant_chain(shared, tenant, {"mem": 4})

    async with open_chain(chain_of("a")) as a:
        await store_through(a, keys)
        a_paths = sorted(level(a).path(k) for k in keys)
    assert all(p.startswith(f"{bucket.prefix}a:v1.{BLOCK}/") for p in a_paths)
    async with open_chain(chain_of("b")) as b:
        assert (await b.find(keys)).count == 0
        other = [bytes(reversed(block(k))) for k in keys]
        await b.store(keys, other)
        await level(b).drain()
        b_paths = sorted(level(b).path(k) for k in keys)
    assert sorted(await bucket.objects()) == sorted(a_paths + b_paths)
    async with open_chain(chain_of("a")) as again:
        assert await load_bytes(again, keys) == [block(k) for k in keys]


@pytest.mark.parametrize("damage", ["flipped", "truncated", "another_key", "foreign", "oversized"])
async def test_a_damaged_object_is_a_counted_miss_and_is_deleted(
    bucket: Bucket, damage: str
) -> None:
    keys = names("bad", 2)
    good = encode_block(keys[0], block(keys[0]))
    flipped = bytearray(good)
    flipped[len(good) - BLOCK // 2] ^= 0xFF  # a byte in the payload
    forged = {
        "flipped": bytes(flipped),
        "truncated": good[: len(good) // 2],
        "another_key": encode_block(keys[1], block(keys[1])),  # same size
        "foreign": b"<html>not a block</html>".ljust(len(good), b" "),  # same size
        "oversized": good + bytes(8 * BLOCK),
    }[damage]
    async with node(bucket.remote()) as chain:
        path = level(chain).path(keys[0])
        await obstore.put_async(bucket.store(), path, forged)
        with pytest.raises(BlockMissing):
            await chain.load(keys[:1])  # never served...
        stats = level(chain).stats()
        assert (stats["corrupt"], stats["hits"]) == (1, 0)  # ...counted...
        assert chain.lookup(keys[:1]).count == 0  # nothing reached the local tier
        with pytest.raises(FileNotFoundError):
            await obstore.head_async(bucket.store(), path)  # ...and deleted
        assert (await chain.find(keys[:1])).count == 0


async def test_another_block_size_never_finds_the_objects(bucket: Bucket) -> None:
    keys = names("sized", 3)
    async with node(bucket.remote(), write_through=True) as a:
        await store_through(a, keys)
    async with node(bucket.remote(), block_bytes=2 * BLOCK) as b:
        assert (await b.find(keys)).count == 0
        with pytest.raises(BlockMissing):
            await b.load(keys)
        assert level(b).stats()["corrupt"] == 0  # not seen, so not taken for damage
    assert len(await bucket.objects()) == 3  # still there for their own block size


# -- faults -------------------------------------------------------------------------------


@asynccontextmanager
async def faulty(
    bucket: Bucket, proxy: S3FaultProxy, keys: list[BlockKey], deadline: float, **kw: Any
) -> AsyncIterator[TierChain]:
    """A node through ``proxy`` (with ``deadline`` and the settings ``kw``) whose ``keys``
    another node stored in the bucket directly."""
    async with node(bucket.remote(), write_through=True) as writer:
        await store_through(writer, keys)
        assert level(writer).stats()["stores"] == len(keys)
    async with node(bucket.remote(endpoint=proxy.endpoint, deadline=deadline, **kw)) as chain:
        yield chain


# fault, the methods it applies to (None: all), the count that says what happened, the
# deadline (short only where the fault is waited out: nothing else may time out)
FAULTS = [
    ("status:500", None, "errors", GENEROUS),
    ("hang", None, "timeouts", DEADLINE),
    ("refuse", None, "errors", GENEROUS),
    ("slow", ["GET"], "timeouts", GENEROUS),
    ("truncate", ["GET"], "errors", GENEROUS),
    ("flip", ["GET"], "corrupt", GENEROUS),
]


@pytest.mark.parametrize(
    ("fault", "methods", "counted", "deadline"),
    FAULTS,
    ids=["status-500", "hang", "refuse", "slow-body", "truncate", "flip"],  # not "slow": a mark
)
async def test_a_fault_is_a_bounded_miss_never_an_exception(
    bucket: Bucket,
    s3_proxy: S3FaultProxy,
    fault: str,
    methods: list[str] | None,
    counted: str,
    deadline: float,
) -> None:
    keys = names("fault", 4)
    s3_proxy.slow_bytes_per_s = 1024  # a block's body takes 16 s: past the deadline
    async with faulty(bucket, s3_proxy, keys, deadline) as chain:
        s3_proxy.set_fault(fault, methods=methods)
        async with asyncio.timeout(guard(deadline)):
            found = await chain.find(keys)
        # A fault of GETs only leaves the existence check (HEAD) answered.
        assert found.count == (len(keys) if methods else 0)
        async with asyncio.timeout(guard(deadline)):
            with pytest.raises(BlockMissing):
                await chain.load(keys)
        async with asyncio.timeout(guard(deadline)):
            assert await level(chain).get(keys) == []
        stats = level(chain).stats()
        assert stats[counted] >= 1, stats
        others = {"errors", "timeouts", "corrupt"} - {counted}
        assert all(stats[name] == 0 for name in others), stats
        assert stats["hits"] == 0 and chain.lookup(keys).count == 0
        assert s3_proxy.faulted[fault] >= 1
        paths = [level(chain).path(k) for k in keys]
    # Only the object that failed its check is deleted; the others wait for the next read.
    kept = [p for p in paths if fault != "flip" or p != paths[0]]
    assert await bucket.objects() == sorted(kept)


async def test_a_hung_server_does_not_stall_the_event_loop(
    bucket: Bucket, s3_proxy: S3FaultProxy
) -> None:
    keys = names("hung", 2)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        for _ in range(10_000):
            ticks += 1
            await asyncio.sleep(0.01)

    async with faulty(bucket, s3_proxy, keys, DEADLINE) as chain:
        s3_proxy.set_fault("hang")
        task = asyncio.create_task(ticker())
        try:
            async with asyncio.timeout(guard(DEADLINE)):
                assert (await chain.find(keys)).count == 0
        finally:
            task.cancel()
        assert ticks >= 3  # it ran while the lookup waited on the hung server
        stats = level(chain).stats()
        # Requests on the wire when the deadline passed: timeouts (not the pool's queue),
        # and a failed batch for the breaker.
        assert (stats["timeouts"], stats["busy"]) == (len(keys), 0), stats
        for _ in range(2):
            async with asyncio.timeout(guard(DEADLINE)):
                assert (await chain.find(keys)).count == 0
        assert level(chain).stats()["state"] == "open"


async def test_the_breaker_opens_refuses_at_once_and_closes_when_the_fault_clears(
    bucket: Bucket, s3_proxy: S3FaultProxy
) -> None:
    keys = names("breaker", 3)
    # A back-off far longer than the refused calls below take, even on a loaded machine.
    async with faulty(bucket, s3_proxy, keys, GENEROUS, breaker_backoff=1.5) as chain:
        s3_proxy.set_fault("status:500")
        for _ in range(3):  # breaker_failures failed batches
            assert level(chain).stats()["state"] == "closed"
            async with asyncio.timeout(guard(GENEROUS)):
                assert (await chain.find(keys)).count == 0
        stats = level(chain).stats()
        assert (stats["state"], stats["breaker_opened"]) == ("open", 1)
        assert stats["errors"] == 3 * len(keys)
        asked, refused = sum(s3_proxy.requests.values()), stats["refused"]
        for _ in range(3):
            assert (await chain.find(keys)).count == 0
            with pytest.raises(BlockMissing):
                await chain.load(keys)
        assert sum(s3_proxy.requests.values()) == asked  # refused without asking
        assert level(chain).stats()["refused"] == refused + 6
        s3_proxy.set_fault(None)
        breaker = level(chain).calls.breaker
        await asyncio.sleep(breaker.retry_in_s + 0.05)  # the back-off, then one probe
        assert (await chain.find(keys)).count == len(keys)
        assert level(chain).stats()["state"] == "closed"
        assert await load_bytes(chain, keys) == [block(k) for k in keys]


async def test_a_deleted_bucket_is_a_miss_and_refuses_writes(
    seaweed: SeaweedServer, bucket: Bucket
) -> None:
    name = f"gone-{secrets.token_hex(4)}"
    await asyncio.to_thread(seaweed.shell, f"s3.bucket.create -name {name}")
    keys, later = names("gone", 3), names("later", 2)
    # A generous deadline: the server makes a new bucket's first volumes on its first
    # writes, which can take longer than a short deadline allows.
    async with node(bucket.remote(bucket=name), write_through=True) as chain:
        await store_through(chain, keys)
        assert level(chain).stats()["stores"] == len(keys)
        chain.clear()
        await asyncio.to_thread(seaweed.delete_bucket, name)
        async with asyncio.timeout(GENEROUS * 4 + 1):
            assert (await chain.find(keys)).count == 0
            with pytest.raises(BlockMissing):
                await chain.load(keys)
            await store_through(chain, later)
        stats = level(chain).stats()
        # "No such bucket" is an answer: misses, with the breaker closed and no fault.
        assert (stats["misses"], stats["hits"], stats["corrupt"]) == (len(keys), 0, 0)
        assert (stats["errors"], stats["timeouts"], stats["state"]) == (0, 0, "closed")
        # A write after it is stored (SeaweedFS makes the bucket again on a PUT) or
        # refused (AWS: NoSuchBucket), each block one or the other, never an exception.
        written = stats["stores"] - len(keys)
        assert written + stats["write_errors"] == len(later), stats


# -- Redis above S3 -----------------------------------------------------------------------


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as running:
        yield running


def stacked(bucket: Bucket, redis: RedisServer) -> dict[str, Any]:
    return {"url": redis.url, "deadline": GENEROUS, "breaker_backoff": 5, "below": bucket.remote()}


async def test_a_stack_writes_both_finds_in_s3_what_redis_lost_and_promotes_it(
    bucket: Bucket, redis: RedisServer
) -> None:
    keys = names("stacked", 4)
    async with node(stacked(bucket, redis), write_through=True) as a:
        await store_through(a, keys)
        each = stack(a).stats()["levels"]
        assert [(s["name"], s["medium"], s["stores"]) for s in each] == [
            ("remote", "REMOTE", 4),
            ("s3", "OBJECT", 4),
        ]
    assert redis.cli("DBSIZE").strip() == "4"
    assert len(await bucket.objects()) == 4
    redis.cli("FLUSHALL")
    async with node(stacked(bucket, redis)) as b:
        assert (await b.find(keys)).count == 4  # from the bucket
        assert await load_bytes(b, keys) == [block(k) for k in keys]
        await stack(b).drain()
        assert stack(b).stats()["stack_promotions"] == 4
        top, below = stack(b).stats()["levels"]
        assert (top["hits"], below["hits"], top["stores"]) == (0, 4, 4)
    assert redis.cli("DBSIZE").strip() == "4"  # promoted back into Redis


async def test_with_redis_dead_the_bucket_keeps_serving(bucket: Bucket, redis: RedisServer) -> None:
    keys = names("no-redis", 3)
    async with node(stacked(bucket, redis), write_through=True) as a:
        await store_through(a, keys)
    redis.kill()
    async with node(stacked(bucket, redis)) as b:
        for _ in range(4):  # more failed batches than Redis's breaker allows
            b.clear()
            async with asyncio.timeout(GENEROUS * 4 + 1):
                assert (await b.find(keys)).count == len(keys)
                assert await load_bytes(b, keys) == [block(k) for k in keys]
        top, below = stack(b).stats()["levels"]
        assert top["state"] == "open" and top["errors"] >= 1
        assert below["state"] == "closed" and below["hits"] == 4 * len(keys)


async def test_a_flush_through_a_stack_says_per_level_which_writes_did_not_land(
    bucket: Bucket, redis: RedisServer
) -> None:
    """Issue 61, item 2: a flush waits for the writes it causes and counts, per level and
    by cause, those that did not land: with Redis dead, every block is in the bucket and
    none in Redis, and the flush says so."""
    keys = names("stack-flush", 3)
    redis.kill()
    async with node(stacked(bucket, redis)) as chain:
        await chain.store(keys, [block(k) for k in keys])
        async with asyncio.timeout(GENEROUS * 4 + 1):
            done = await chain.flush()
        assert (done.remote_sent, done.not_landed) == (len(keys), len(keys)), done
        assert done.remote_missed == {"remote": {"errors": len(keys)}, "s3": {}}, done
        assert done.remote_reason == f"3 of 3 not written to remote ({len(keys)} errors)"
        assert done.failed and done.copied == 0, done
    assert len(await bucket.objects()) == len(keys)


# -- config -------------------------------------------------------------------------------


def quiet_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No TIERD_* variable of this process changes the checked config."""
    for name in list(os.environ):
        if name.startswith("TIERD_") and name != "TIERD_HYPOTHESIS_PROFILE":
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))


def check(tmp_path: Path, remote: dict[str, Any]) -> tuple[int, str]:
    """``tierd config check --offline`` on a config of one tier over ``remote``."""
    path = tmp_path / "tierd.yaml"
    tier = {"name": "cpu", "kind": "cpu", "capacity": 16}
    path.write_text(yaml.safe_dump({"block_bytes": BLOCK, "tiers": [tier], "remote": remote}))
    return main(["config", "check", "--offline", str(path)]), str(path)


S3 = {"kind": "s3", "endpoint": "http://127.0.0.1:9000", "bucket": "blocks"}
BAD_CONFIGS = [
    ({**S3, "bucket": "Bad_Bucket"}, "remote.bucket: ", "not an S3 bucket name"),
    ({**S3, "endpoint": "ftp://host/x"}, "remote.endpoint: ", "http(s)://host[:port]"),
    ({**S3, "access_key_id": "AK"}, "remote.access_key_id: ", "secret_access_key_file"),
    ({**S3, "key_prefx": "a/"}, "remote.key_prefx: ", "did you mean remote.key_prefix?"),
    (
        {"url": "redis://127.0.0.1:6379/0", "below": {**S3, "admission": "reuse>=2"}},
        "remote.below.admission: ",
        "set it on the first level",
    ),
    (
        {"url": "redis://127.0.0.1:6379/0", "name": "one", "below": {**S3, "name": "one"}},
        "remote.below.name: ",
        "names two remote levels",
    ),
]


@pytest.mark.parametrize(
    ("remote", "where", "says"),
    BAD_CONFIGS,
    ids=["bucket", "endpoint", "key-id-alone", "misspelt", "admission-below", "one-name-twice"],
)
def test_config_check_names_the_bad_value(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    remote: dict[str, Any],
    where: str,
    says: str,
) -> None:
    quiet_environ(monkeypatch, tmp_path)
    status, _ = check(tmp_path, remote)
    err = capsys.readouterr().err
    assert status == 78, err
    assert "Traceback" not in err
    line = next((line for line in err.splitlines() if line.startswith(where)), "")
    assert says in line, err


def test_config_check_accepts_a_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    quiet_environ(monkeypatch, tmp_path)
    assert check(tmp_path, {"url": "redis://127.0.0.1:6379/0", "below": S3})[0] == 0


def test_stats_of_several_tenants_keep_each_levels_latest_error() -> None:
    """Tenants' stats merged: each level of a stack keeps its latest error and its time
    (not the first tenant's, not a sum of times), and adds its counts up."""
    from tierd.control.figures.stats import merge_stats

    def snapshot(at: float, error: str) -> dict[str, Any]:
        level = {"state": "closed", "errors": 1, "last_error": error, "last_error_at": at}
        levels = [{**level, "name": "redis"}, {**level, "name": "s3", "recovered": False}]
        remote = {**level, "name": "redis+s3", "recovered": False, "levels": levels}
        chain = {"hit_blocks": 0, "miss_blocks": 0}
        return {"block_bytes": BLOCK, "tiers": [], "routes": [], "chain": chain, "remote": remote}

    merged = merge_stats([snapshot(100.0, "early"), snapshot(200.0, "late")])
    for level in merged["remote"]["levels"]:
        assert (level["last_error"], level["last_error_at"], level["errors"]) == ("late", 200.0, 2)
