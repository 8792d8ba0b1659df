"""The daemon under test as the campaign holds it, and the checks run against it.

:class:`Rig`: the daemon's process, the :class:`FaultSwitch` over its disk faults, the
stuck subscriber, the campaign's own control connection, the lifecycle lock (one restart
or check at a time) and the run's record (timeline, problems, faults injected, restarts).
:class:`Checks`: durability (the blocks on the disk tier before a kill, each served back
byte-identical after it), the sweep that loads and verifies every block still held, and
the blocks of stores whose client was killed (never visible).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

from soak_daemon import FaultControl, FaultPlan
from soak_fuzz import StuckSubscriber
from soak_hostile import RealFullDisk
from soak_load import KeySpace, Tally, close_client, error_kind
from soak_procs import DaemonProcess, idle_figures, wait_idle
from soak_settings import DEADLINE_S, NAMESPACE

from tierd.client import Client, DaemonError, Unreachable


class FaultSwitch:
    """The disk lane's wish, unless suspended (durability checks and restarts run with a
    healthy disk: they check the crash, not a crash with a failing drive at once)."""

    def __init__(self, control: FaultControl, full_disk: RealFullDisk) -> None:
        self.control = control
        self.full_disk = full_disk  # the real full file system, filled while wanted
        self.wanted = FaultPlan()
        self.full_wanted = False
        self.suspended = 0

    def want(self, plan: FaultPlan) -> None:
        self.wanted = plan
        self._apply()

    def want_full(self, full: bool) -> bool:
        """Fill (or free) the real file system; whether it is full now."""
        self.full_wanted = full
        return self._apply()

    def suspend(self) -> None:
        self.suspended += 1
        self._apply()

    def resume(self) -> None:
        self.suspended -= 1
        self._apply()

    def _apply(self) -> bool:
        self.control.set(FaultPlan() if self.suspended else self.wanted)
        if self.full_wanted and not self.suspended:
            return self.full_disk.fill()
        self.full_disk.release()
        return False


class Rig:
    """The daemon under test, restarted as the faults demand, and the run's record.
    Times in the timeline count from ``tally.started`` (the start of the load)."""

    def __init__(self, daemon: DaemonProcess, faults: FaultSwitch, tally: Tally) -> None:
        self.daemon = daemon
        self.faults = faults
        self.tally = tally
        self.injected: Counter[str] = Counter()
        self.problems: list[str] = []
        self.timeline: list[tuple[float, str]] = []
        self.restarts = 0
        self.lifecycle = asyncio.Lock()
        self.subscriber: StuckSubscriber | None = None
        self._ctl: Client | None = None
        self._ctl_lock = asyncio.Lock()

    @property
    def path(self) -> str:
        return self.daemon.socket_path

    def note(self, event: str) -> None:
        """One line of the run's timeline (seconds from the start of the load)."""
        self.timeline.append((round(time.monotonic() - self.tally.started, 2), event))

    async def kill_and_start(self, *, killed: bool = True) -> None:
        if killed:
            await self.daemon.kill()
        await self.close_ctl()
        self.unsubscribe()
        self.faults.suspend()
        began = time.monotonic()
        try:
            await self.daemon.start()
        finally:
            self.faults.resume()
        self.restarts += 1
        self.note(
            f"restarted: incarnation {self.daemon.incarnation} ready after"
            f" {time.monotonic() - began:.1f} s"
        )
        self.subscribe()

    def subscribe(self) -> None:
        try:
            self.subscriber = StuckSubscriber(self.path)
        except OSError as exc:
            self.problems.append(f"cannot open the stuck subscriber: {exc}")
            return
        self.injected["stuck_subscriber"] += 1

    def unsubscribe(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
            self.subscriber = None

    async def control(self) -> Client:
        """The campaign's own connection (stats, checks), opened once per incarnation."""
        async with self._ctl_lock:
            if self._ctl is None:
                self._ctl = await Client.connect(self.path, namespace=NAMESPACE)
            return self._ctl

    async def close_ctl(self) -> None:
        ctl, self._ctl = self._ctl, None
        await close_client(ctl)


class Checks:
    """What the daemon must have kept, checked through the rig's control connection;
    ``connections()`` is how many connections the campaign holds now."""

    def __init__(
        self, rig: Rig, keys: KeySpace, tally: Tally, connections: Callable[[], int]
    ) -> None:
        self.rig = rig
        self.keys = keys
        self.tally = tally
        self.connections = connections
        self.durability: Counter[str] = Counter()
        self.lost_examples: list[str] = []
        self.aborted_visible = 0

    async def check_victims(self, keys: list[bytes]) -> None:
        """Blocks of a store that was never committed are never visible (its slots held
        wrong bytes)."""
        try:
            async with asyncio.timeout(DEADLINE_S):
                ctl = await self.rig.control()
                found = await ctl.lookup(keys)
                if found.count:
                    self.aborted_visible += found.count
                    self.tally.verify(keys, await ctl.load(keys[: found.count]), "aborted store")
        except (DaemonError, Unreachable, OSError, TimeoutError) as exc:
            self.tally.error(f"control:{error_kind(exc)}")

    async def disk_set(self, where: str) -> list[bytes] | None:
        """With the load stopped: wait until the daemon is idle, flush, drop the CPU tier,
        and return the keys still present (all on the disk tier)."""
        problems = self.rig.problems
        try:
            async with asyncio.timeout(DEADLINE_S * 4):
                ctl = await self.rig.control()
                if await wait_idle(ctl, self.connections) is None:
                    stats = idle_figures(await ctl.stats())
                    problems.append(f"{where}: the daemon never became idle: {stats}")
                    return None
                await ctl.flush()
                async with await Client.connect(self.rig.path) as operator:
                    await operator.clear("cpu")
                keys = self.keys.all_keys()
                replies = await asyncio.gather(*(ctl.send("lookup", keys=[k]) for k in keys))
        except (DaemonError, Unreachable, OSError, TimeoutError) as exc:
            problems.append(f"{where}: the durability snapshot failed: {exc!r}")
            return None
        present = [k for k, r in zip(keys, replies, strict=True) if r["count"]]
        elsewhere = [
            k for k, r in zip(keys, replies, strict=True) if r["count"] and r["media"] != ["DISK"]
        ]
        if elsewhere:
            problems.append(f"{where}: {len(elsewhere)} blocks not on DISK after clear")
        return present

    async def verify_durable(self, keys: list[bytes], where: str) -> None:
        self.durability["checks"] += 1
        self.durability["blocks"] += len(keys)
        try:
            async with asyncio.timeout(DEADLINE_S * 4):
                ctl = await self.rig.control()
                for i in range(0, len(keys), 16):
                    part = keys[i : i + 16]
                    loads = await asyncio.gather(*(ctl.load([k]) for k in part))
                    for key, blocks in zip(part, loads, strict=True):
                        if not blocks:
                            self.durability["lost"] += 1
                            if len(self.lost_examples) < 20:
                                self.lost_examples.append(f"{where}: {key!r}")
                        else:
                            self.durability["wrong"] += self.tally.verify([key], blocks, where)
        except (DaemonError, Unreachable, OSError, TimeoutError) as exc:
            self.rig.problems.append(f"{where}: the durability check failed: {exc!r}")

    async def sweep(self, where: str) -> None:
        """Load and verify every block the daemon still holds."""
        try:
            async with asyncio.timeout(DEADLINE_S * 4):
                ctl = await self.rig.control()
                keys = self.keys.all_keys()
                replies = await asyncio.gather(*(ctl.send("lookup", keys=[k]) for k in keys))
                present = [k for k, r in zip(keys, replies, strict=True) if r["count"]]
                for i in range(0, len(present), 16):
                    part = present[i : i + 16]
                    loads = await asyncio.gather(*(ctl.load([k]) for k in part))
                    for key, blocks in zip(part, loads, strict=True):
                        self.tally.verify([key], blocks, where)
                        self.tally.blocks["swept"] += len(blocks)
        except (DaemonError, Unreachable, OSError, TimeoutError) as exc:
            self.rig.problems.append(f"{where}: the sweep failed: {exc!r}")
