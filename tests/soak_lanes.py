"""The soak's two fault lanes, at seeded times (:func:`schedule`).

The *process lane* SIGKILLs the daemon (a *checkpoint* kill after a durability snapshot,
or a *hot* kill under full load) and restarts it, and SIGKILLs clients holding a store or
a load lease. The *disk lane* runs episodes of injected write EIO, write ENOSPC, a full
disk (torn block writes and journal ENOSPC), read EIO, a slow disk and, as root, a real
file system filled up. :class:`FaultLanes` runs both on a :class:`~soak_rig.Rig`.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import signal
import time
from pathlib import Path
from typing import Any

from soak_daemon import FaultPlan
from soak_fuzz import Fuzzer
from soak_load import Gate, KeySpace
from soak_procs import spawn_holder
from soak_rig import Checks, Rig
from soak_settings import (
    CLIENT_FAULTS,
    DISK_EPISODES,
    EPISODE_COUNTERS,
    PROCESS_FAULTS,
    Settings,
)


def schedule(settings: Settings, rng: random.Random) -> dict[str, Any]:
    """Seeded fault times (seconds from the start of the load): every kind at least once,
    more in longer runs; disk episodes never overlap; the last kill comes by 70% of the
    run so the last incarnation runs long enough to judge its memory."""
    d = settings.seconds
    warm, last = min(30.0, 0.15 * d), 0.7 * d
    kills = [PROCESS_FAULTS[i % 2] for i in range(max(2, round(d / 120)))]
    clients = [CLIENT_FAULTS[i % 2] for i in range(max(2, round(d / 60)))]
    process = kills + clients
    rng.shuffle(process)
    times = sorted(rng.uniform(warm, last) for _ in process)
    episode = min(15.0, max(3.0, d / 40))
    rounds = max(1, int((last - warm) // (2 * len(DISK_EPISODES) * episode)))
    disk: list[str] = []
    for _ in range(rounds):
        kinds = list(DISK_EPISODES)
        rng.shuffle(kinds)
        disk += kinds
    free = max(0.0, last - warm - len(disk) * episode)
    cuts = sorted(rng.uniform(0, free) for _ in disk)
    starts = [warm + cut + i * episode for i, cut in enumerate(cuts)]
    return {
        "warmup_s": warm,
        "episode_s": episode,
        "process": list(zip(times, process, strict=True)),
        "disk": list(zip(starts, disk, strict=True)),
    }


class FaultLanes:
    """Runs the process lane and the disk lane of ``plan`` (see :func:`schedule`); every
    fault that really happened is counted in ``rig.injected``. The load stops (``gate``)
    for a checkpoint kill, the fuzzer's connection with it."""

    def __init__(
        self,
        rig: Rig,
        checks: Checks,
        plan: dict[str, Any],
        keys: KeySpace,
        gate: Gate,
        fuzzer: Fuzzer,
        workdir: Path,
        rng: random.Random,
    ) -> None:
        self.rig, self.checks, self.plan = rig, checks, plan
        self.keys, self.gate, self.fuzzer = keys, gate, fuzzer
        self.workdir, self.rng = workdir, rng
        self._victims = itertools.count()

    async def run(self) -> None:
        await asyncio.gather(self._process_lane(), self._disk_lane())

    async def _at(self, offset: float) -> None:
        left = self.rig.tally.started + offset - time.monotonic()
        if left > 0:
            await asyncio.sleep(left)  # the seeded time of the next fault

    async def _process_lane(self) -> None:
        rig = self.rig
        for offset, kind in self.plan["process"]:
            await self._at(offset)
            if kind == "daemon_sigkill_checkpoint":
                await self._checkpoint_kill()
            elif kind == "daemon_sigkill_hot":
                async with rig.lifecycle:
                    rig.injected[kind] += 1
                    rig.note("SIGKILL under load")
                    await rig.kill_and_start()
            else:
                await self._kill_client("store" if kind.endswith("store") else "load")

    async def _disk_lane(self) -> None:
        """Each episode counts once the layer really failed (or slowed) a call; one that
        fell into a restart (faults suspended) or an idle disk is run again."""
        rig = self.rig
        control = rig.daemon.control
        for offset, kind in self.plan["disk"]:
            await self._at(offset)
            if kind == "disk_real_full":
                await self._real_full_episode()
                continue
            counter = EPISODE_COUNTERS[kind]
            for _attempt in range(3):
                before = control.counters()[counter]
                rig.note(f"{kind} starts")
                rig.faults.want(DISK_EPISODES[kind])
                await asyncio.sleep(self.plan["episode_s"])  # the episode's length
                rig.faults.want(FaultPlan())
                injected = control.counters()[counter] - before
                rig.note(f"{kind} ends: {injected} calls faulted")
                if injected:
                    rig.injected[kind] += 1
                    break

    async def _real_full_episode(self) -> None:
        """Fill the tmpfs directory of the disk tier, hold it full, free it again (it is
        freed too while faults are suspended: checkpoints and restarts see a healthy
        disk). An attempt that fell into a suspension is run again."""
        rig = self.rig
        if rig.faults.full_disk.directory is None:
            rig.note("disk_real_full skipped: no tmpfs (not root)")
            return
        for _attempt in range(3):
            full = rig.faults.want_full(True)
            rig.note(f"disk_real_full: {'the tmpfs is full' if full else 'suspended'}")
            try:
                await asyncio.sleep(self.plan["episode_s"])
            finally:
                rig.faults.want_full(False)
                rig.note("disk_real_full: space freed")
            if full:
                rig.injected["disk_real_full"] += 1
                return

    async def _kill_client(self, mode: str) -> None:
        rig = self.rig
        kind = f"client_killed_mid_{mode}"
        for _attempt in range(3):
            if mode == "store":  # fresh keys nobody else stores: they must never appear
                keys = [f"victim-{next(self._victims)}-{i}".encode() for i in range(4)]
            else:
                keys = self.keys.pick(self.rng)
            began = time.monotonic()
            proc, line = await spawn_holder(rig.path, mode, keys, self.workdir / "holders.log")
            if proc.returncode is None:
                proc.send_signal(signal.SIGKILL)
            await proc.wait()
            took = time.monotonic() - began
            rig.note(f"client holding a {mode} lease SIGKILLed: {line!r} after {took:.1f} s")
            if line.startswith("ready"):
                rig.injected[kind] += 1
            else:
                rig.tally.error(f"holder:{line or 'no answer'}")
            if mode == "store":
                await self.checks.check_victims(keys)
            if line.startswith("ready"):
                return

    async def _checkpoint_kill(self) -> None:
        rig, checks = self.rig, self.checks
        async with rig.lifecycle:
            rig.faults.suspend()
            try:
                await self.gate.close()
                await self.fuzzer.disconnect()
                rig.note("checkpoint: load stopped")
                durable = await checks.disk_set("checkpoint")
                rig.note(f"checkpoint: {len(durable or [])} blocks on DISK; SIGKILL")
                rig.injected["daemon_sigkill_checkpoint"] += 1
                await rig.kill_and_start()
                if durable is not None:
                    lost = checks.durability["lost"]
                    await checks.verify_durable(durable, "after SIGKILL")
                    rig.note(f"checkpoint: verified, {checks.durability['lost'] - lost} lost")
            finally:
                self.gate.open()
                rig.faults.resume()
