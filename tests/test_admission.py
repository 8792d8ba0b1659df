"""Admission ``reuse>=N`` counts requests, not calls: a request's lookup and its touch are
one use, so ``reuse>=2`` means "seen in two requests"."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from admission_kit import chain_yaml, write_trace

from tierd.cli import main
from tierd.client import Client, DaemonError
from tierd.testing import daemon_config, running_daemon


def simulate(tmp_path: Path, admission: str, capsys: pytest.CaptureFixture[str]) -> Any:
    trace = write_trace(tmp_path / "trace.jsonl")
    args = ["simulate", str(trace), "--config", str(chain_yaml(tmp_path, admission)), "--json"]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def disk_stores(result: Any) -> int:
    return int(next(t["stores"] for t in result["tiers"] if t["name"] == "disk"))


@pytest.mark.parametrize(
    ("admission", "stores", "disk_hits"),
    [
        ("always", 4, 2),  # keys 1 and 2 (request 3), then 3 and 4 (request 4's promotion)
        ("reuse>=2", 1, 1),  # only key 1, seen in two requests
        ("reuse>=3", 0, 0),  # nothing was seen in three requests before it was demoted
    ],
)
def test_a_use_is_one_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], admission: str, stores: int, disk_hits: int
) -> None:
    result = simulate(tmp_path, admission, capsys)
    assert disk_stores(result) == stores
    assert result["hits_by_medium"].get("DISK", 0) == disk_hits


@asynccontextmanager
async def reuse_twice_client(tmp_path: Path) -> AsyncIterator[Client]:
    """A client of a daemon with 2 CPU blocks over a disk tier that admits ``reuse>=2``."""
    config = daemon_config(tmp_path, cpu_blocks=2, disk_blocks=8)
    config["tiers"][1]["admission"] = "reuse>=2"
    async with running_daemon(config) as daemon:
        path = daemon.config.socket.path
        async with await Client.connect(path, namespace="adm") as client:
            yield client


async def test_lookup_then_touch_over_the_socket_counts_once(tmp_path: Path) -> None:
    """The daemon counts what a client's touch says, however many lookups it made."""
    once, twice, filler = b"k-once", b"k-twice", [b"f-1", b"f-2"]
    async with reuse_twice_client(tmp_path) as client:
        await client.store([once, twice], [bytes(4096)] * 2)
        for _ in range(3):  # a request that polls: lookups are queries
            await client.lookup([once, twice])
        await client.touch([once, twice])  # request 1 uses both
        await client.lookup([twice])
        await client.touch([twice, twice])  # request 2 uses `twice` (listed twice)
        await client.store(filler, [bytes(4096)] * 2)  # both demoted
        found = await client.lookup([twice])
        assert (found.count, found.media) == (1, ("DISK",))
        assert (await client.lookup([once])).count == 0


async def test_a_touch_for_order_only_counts_no_use(tmp_path: Path) -> None:
    """``uses: false`` (SGLang's backend, after every call) orders without counting a use;
    a ``uses`` that is not a boolean is refused, and nothing is touched."""
    ordered, used, filler = b"k-ordered", b"k-used", [b"f-1", b"f-2"]
    async with reuse_twice_client(tmp_path) as client:
        await client.store([ordered, used], [bytes(4096)] * 2)
        for _ in range(3):
            await client.touch([ordered], uses=False)
        await client.touch([used])
        await client.touch([used])
        with pytest.raises(DaemonError, match="'uses' must be a boolean"):
            await client.request("touch", keys=[used], uses=1)
        await client.store(filler, [bytes(4096)] * 2)  # both demoted
        assert (await client.lookup([used])).media == ("DISK",)
        assert (await client.lookup([ordered])).count == 0  # refused: never used twice
