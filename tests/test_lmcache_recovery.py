"""LMCache's adapter around a daemon that stops answering (issue 61, item 7): every task
ends within its deadline, and the adapter serves again within a second of the daemon.

1. Through LMCache's own code (tests/lmcache_driver.py in .venv-lmcache's python, as in
   tests/test_lmcache.py): a real ``tierd serve`` is SIGSTOPped for 3 s while a store is
   in flight; LMCache keeps storing and loading meanwhile (the breaker answers). After
   SIGCONT the first load that finds and copies every object must come back within a
   second of SIGCONT.
2. The adapter's namespace (:class:`~tierd.integrations.lmcache.space.Space`) directly,
   on a real daemon: a store whose daemon stops between its reservation and its commit
   ends within its deadline, however long the link takes to let the silent connection
   go; a lock whose pins are granted after it gave up (the link's thread stalled) ends
   within its deadline and the daemon unpins them; a commit whose reservation's
   connection was lost fails, without touching the link's new connection.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from lmcache_driver import adapter_json
from lmcache_kit import BLOCK, LIVENESS_S, REASON, Lmcache, all_identical, config, delete_from

from tierd.client import Client, Unreachable
from tierd.control.clients.handshake import DaemonSilent
from tierd.integrations.lmcache import space as lmcache_space
from tierd.integrations.lmcache.space import Space, SpaceSettings

pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

DEADLINE_S = 0.5
STOPPED_S = 3.0
BACK_S = 1.0  # the adapter serves again within this of SIGCONT
COUNT = 16
SLACK_S = 0.2  # a task's end past its deadline: the hand-over from the link's thread
CLOSE_S = 0.6  # a connection's teardown (a large pool's unmapping, say)


class Pipelined(Lmcache):
    """A driver to which a command can be sent before the last one is answered."""

    def send(self, op: str, **fields: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict[str, Any]:
        return self._answer()


def first_full_load(server: Pipelined, since: float, tries: int = 2000) -> float | None:
    """Seconds from ``since`` to the answer of the first load of seed 1 that finds and
    copies every object (bounded in loads and in LIVENESS_S); every object loaded on the
    way must be right. None: no such load."""
    deadline = since + LIVENESS_S
    for _ in range(tries):
        answer = server.load(seed=1, count=COUNT)
        answered = time.monotonic()
        assert answer["finished"], answer
        assert answer.get("identical") == answer.get("loaded"), answer
        if all_identical(answer, COUNT):
            return answered - since
        if answered > deadline:
            break
    return None


async def test_lmcache_is_served_within_a_second_of_a_stopped_daemon_resuming(
    tmp_path: Path, spawn: Any
) -> None:
    daemon = await spawn(config(tmp_path, cpu_blocks=1024, disk_blocks=None))
    spec = adapter_json(daemon.socket_path, deadline_s=DEADLINE_S)
    server = Pipelined(spec)
    try:
        assert server.store(seed=1, count=COUNT)["ok"]
        assert all_identical(server.load(seed=1, count=COUNT), COUNT)
        server.send("store", seed=2, count=64)  # in flight when the daemon stops
        daemon.signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            assert server.answer()["finished"]
            seed = 3
            while time.monotonic() - stopped < STOPPED_S and seed < 5000:
                stored = server.store(seed=seed, count=COUNT)
                assert stored["finished"] and stored["elapsed_s"] < LIVENESS_S, stored
                missed = server.load(seed=1, count=COUNT)
                assert missed["finished"] and missed["lookup_s"] < LIVENESS_S, missed
                seed += 1
        finally:
            daemon.signal(signal.SIGCONT)
        resumed = time.monotonic()
        back = first_full_load(server, resumed)
        assert back is not None, server.log()
        assert back < BACK_S, f"served again {back:.2f} s after SIGCONT\n{server.log()}"
        assert server.store(seed=9000, count=COUNT)["ok"]
    finally:
        server.close()


# -- 2. the namespace's calls, directly ---------------------------------------------------------


def space_on(socket_path: str) -> Space:
    return Space(SpaceSettings(socket_path, "ns", BLOCK, DEADLINE_S, 3, 0.5, (), 2))


async def test_a_store_whose_daemon_stops_before_its_commit_ends_within_its_deadline(
    tmp_path: Path, spawn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = await spawn(config(tmp_path))
    space = space_on(daemon.socket_path)
    block = bytes(BLOCK)
    close = Client.close

    async def slow_close(client: Client) -> None:  # the link lets a connection go slowly
        await close(client)
        await asyncio.sleep(CLOSE_S)

    copy = lmcache_space.copy_bytes
    stopped: list[float] = []

    def copy_then_stop(dst: Any, src: Any) -> None:  # reserved, copied: the daemon stops
        copy(dst, src)
        if not stopped:
            daemon.signal(signal.SIGSTOP)
            stopped.append(time.monotonic())

    try:
        assert await asyncio.to_thread(space.store, [b"w"], [block], time.monotonic() + 5) > 0
        monkeypatch.setattr(Client, "close", slow_close)
        monkeypatch.setattr(lmcache_space, "copy_bytes", copy_then_stop)
        started = time.monotonic()
        with pytest.raises(DaemonSilent):
            await asyncio.to_thread(space.store, [b"a"], [block], started + DEADLINE_S)
        took = time.monotonic() - started
    finally:
        daemon.signal(signal.SIGCONT)
    resumed = time.monotonic()
    try:
        assert stopped and took < DEADLINE_S + SLACK_S, f"the store took {took:.2f} s"
        assert space.link.breaker.wait_closed(LIVENESS_S)  # the probe found the daemon
        assert time.monotonic() - resumed < BACK_S
        # (b"a" may be in: its commit, sent into the stopped daemon's socket, is read late)
        stored = await asyncio.to_thread(space.store, [b"b"], [block], time.monotonic() + 5)
        assert stored == BLOCK
    finally:
        space.close()


async def test_a_commit_whose_connection_was_lost_leaves_the_links_new_one_alone(
    tmp_path: Path, spawn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = await spawn(config(tmp_path))
    space = space_on(daemon.socket_path)
    block = bytes(BLOCK)
    copy = lmcache_space.copy_bytes
    lost: list[Client] = []

    def copy_then_lose(dst: Any, src: Any) -> None:  # the reservation's connection goes
        copy(dst, src)
        if not lost:  # (another task's call got no answer in time, say)
            client = space.link.call(space.link.client(), LIVENESS_S)
            space.link.call(space.link.failed(client, Unreachable("lost")), LIVENESS_S)
            lost.append(client)

    try:
        assert await asyncio.to_thread(space.store, [b"w"], [block], time.monotonic() + 5) > 0
        monkeypatch.setattr(lmcache_space, "copy_bytes", copy_then_lose)
        connects, failures = space.link.connects, space.link.breaker.snapshot().failures
        with pytest.raises(Unreachable):
            await asyncio.to_thread(space.store, [b"a"], [block], time.monotonic() + 5)
        assert lost
        assert space.link.connects == connects  # no connection made and dropped for it
        assert space.link.breaker.snapshot().failures == failures  # the daemon did no wrong
        stored = await asyncio.to_thread(space.store, [b"a"], [block], time.monotonic() + 5)
        assert stored == BLOCK and space.link.connects == connects + 1
    finally:
        space.close()


async def test_a_pin_answered_after_its_task_gave_up_drops_its_connection_so_the_daemon_unpins(
    tmp_path: Path, spawn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = await spawn(config(tmp_path))
    space = space_on(daemon.socket_path)
    keys, blocks = [b"a", b"b"], [bytes(BLOCK)] * 2
    prepare_load = Client.prepare_load

    async def late(client: Client, run: Any) -> Any:  # granted, then the link's loop stalls
        lease = await prepare_load(client, run)
        time.sleep(DEADLINE_S + SLACK_S)  # noqa: ASYNC251  (on purpose: a stalled loop)
        return lease

    try:
        assert await asyncio.to_thread(space.store, keys, blocks, time.monotonic() + 5) > 0
        monkeypatch.setattr(Client, "prepare_load", late)
        started = time.monotonic()
        with pytest.raises(DaemonSilent):
            await asyncio.to_thread(space.lock, keys, started + DEADLINE_S)
        took = time.monotonic() - started
        assert took < DEADLINE_S + SLACK_S, f"the lock took {took:.2f} s"
        deadline = time.monotonic() + LIVENESS_S
        for _ in range(500):  # the connection is dropped on the link's loop: bounded
            removed = (await delete_from(daemon.socket_path, "ns", keys))["removed"]
            if removed == 2 or time.monotonic() > deadline:
                break
        assert removed == 2  # nothing left pinned by the lease granted too late
    finally:
        space.close()
