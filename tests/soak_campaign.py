"""One soak campaign from start to report: :class:`Campaign` builds the pieces (the daemon
and its rig, the workers, the fuzzer, the hostile clients, the fault lanes), runs the load
phase with the lanes beside it and a sampler of the daemon's memory and stats, then the
final phase (sweep, leaks, clean restart), and assembles the report that
:func:`soak_report.judge` judges."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fake_redis import FakeRedis
from soak_fuzz import Fuzzer
from soak_hostile import Hostile, RealFullDisk
from soak_lanes import FaultLanes, schedule
from soak_load import Gate, KeySpace, Tally, Worker
from soak_procs import DaemonFailed, DaemonProcess, idle_figures, wait_idle
from soak_report import daemon_counters, rss_summary
from soak_rig import Checks, FaultSwitch, Rig
from soak_settings import DEADLINE_S, FAULT_KINDS, Settings, soak_config

from tierd.client import DaemonError, Unreachable


class Campaign:
    """One run; :meth:`run` returns the report (see :func:`soak_report.judge` and
    :func:`soak_report.render`)."""

    def __init__(self, settings: Settings, workdir: Path, socket_path: str) -> None:
        self.s = settings
        self.workdir = workdir
        self.plan = schedule(settings, random.Random(settings.seed + 1))
        self.keys = KeySpace(settings.sequences, settings.seq_len)
        self.tally = Tally(settings.block_bytes)
        self.gate = Gate()
        # The tmpfs holds its half of the slab, plus room for the index and a journal.
        share = settings.disk_blocks // 2 * (settings.block_bytes + 4096) + 4096
        self.full_disk = RealFullDisk(workdir, share + (20 << 20))
        config = soak_config(workdir, socket_path, settings, self.full_disk.directory)
        # A hostile Redis server under the remote level the whole run: every call gets a
        # reply declared 2**31 elements long. It may cost misses, never a stalled loop
        # (the latency and liveness checks would see one).
        self.bad_redis = FakeRedis("huge_all")
        config["remote"] = {
            "url": self.bad_redis.url,
            "deadline": "100ms",
            "breaker_backoff": "200ms",
            "breaker_max_backoff": "1s",
        }
        self.daemon = DaemonProcess(workdir, config)
        self.hostile = Hostile(
            lambda: self.path, "soak-hostile", lambda: self.daemon.incarnation, self.gate.turn
        )
        self.real_full = self.full_disk.directory is not None
        self.rig = Rig(self.daemon, FaultSwitch(self.daemon.control, self.full_disk), self.tally)
        self.checks = Checks(self.rig, self.keys, self.tally, self._connections)
        self.rss: list[tuple[float, int, int]] = []  # (seconds, incarnation, KiB)
        self.last_stats: dict[int, dict[str, Any]] = {}
        self.unexpected_exits = 0
        self.exit_statuses: list[int] = []
        self.leaks: dict[str, Any] = {}
        self.stop = asyncio.Event()
        self.workers = [
            Worker(
                self.path, self.keys, self.tally, self.gate, random.Random(settings.seed * 97 + i)
            )
            for i in range(settings.clients)
        ]
        self.fuzzer = Fuzzer(
            self.path,
            random.Random(settings.seed * 89),
            self.gate,
            settings.block_bytes,
            settings.fuzz_frames_per_s,
        )
        self.lanes = FaultLanes(
            self.rig,
            self.checks,
            self.plan,
            self.keys,
            self.gate,
            self.fuzzer,
            workdir,
            random.Random(settings.seed),
        )
        self.load_seconds = 0.0
        self.fault_calls: dict[str, int] = {}

    @property
    def path(self) -> str:
        return self.daemon.socket_path

    def _connections(self) -> int:
        """Connections the campaign holds now: the workers', the subscriber, control."""
        workers = sum(1 for w in self.workers if w.client is not None)
        return workers + (self.rig.subscriber is not None) + 1

    # -- the run ------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        rig = self.rig
        self.bad_redis.start()
        try:
            await self.daemon.start()
            rig.subscribe()
            self.tally.started = time.monotonic()
            await self._load_phase()
            await self._final_phase()
        except DaemonFailed as exc:  # the report still comes, failing, with the reason
            rig.problems.append(str(exc))
        finally:
            await rig.close_ctl()
            rig.unsubscribe()
            await self.daemon.kill()
            self.bad_redis.stop()
            self.hostile.counts["hostile_redis_replies"] = self.bad_redis.streamed
            self.fault_calls = self.daemon.control.counters()
            self.daemon.cleanup()
            self.full_disk.unmount()
        return self.report()

    async def _load_phase(self) -> None:
        tasks = [asyncio.create_task(w.run(self.stop)) for w in self.workers]
        tasks.append(asyncio.create_task(self.fuzzer.run(self.stop)))
        tasks.append(asyncio.create_task(self.hostile.run(self.stop)))
        sampler = asyncio.create_task(self._sample())
        try:
            await self.lanes.run()
            left = self.tally.started + self.s.seconds - time.monotonic()
            if left > 0:
                await asyncio.sleep(left)  # the rest of the run, fault-free
        finally:
            self.load_seconds = time.monotonic() - self.tally.started
            self.rig.note("load stops")
            self.stop.set()
            self.gate.open()
            await asyncio.gather(*tasks)
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler

    async def _sample(self) -> None:
        """Every second: the daemon's RSS; every other: its stats. Restarts a daemon that
        died on its own (that fails the run, but the campaign goes on)."""
        rig = self.rig
        for tick in itertools.count():
            await asyncio.sleep(1.0)  # a sampling period, not a synchronisation
            if rig.lifecycle.locked():
                continue
            if not self.daemon.alive:
                async with rig.lifecycle:
                    if self.daemon.alive:  # restarted by a fault lane meanwhile
                        continue
                    self.unexpected_exits += 1
                    status = self.daemon.proc.returncode if self.daemon.proc else None
                    rig.note(f"the daemon exited on its own (status {status})")
                    rig.problems.append(
                        f"the daemon exited on its own (status {status}), incarnation"
                        f" {self.daemon.incarnation}: see {self.daemon.log_path()}"
                    )
                    await rig.kill_and_start(killed=False)
                continue
            self._sample_rss()
            if tick % 2 == 0:
                with contextlib.suppress(DaemonError, Unreachable, OSError, TimeoutError):
                    async with asyncio.timeout(DEADLINE_S):
                        ctl = await rig.control()
                        self.last_stats[self.daemon.incarnation] = await ctl.stats()

    def _sample_rss(self) -> None:
        kib = self.daemon.rss_kib()
        if kib is not None:
            now = time.monotonic() - self.tally.started
            self.rss.append((round(now, 1), self.daemon.incarnation, kib))

    async def _final_phase(self) -> None:
        rig, checks = self.rig, self.checks
        rig.unsubscribe()
        rig.faults.suspend()
        async with rig.lifecycle:
            if not self.daemon.alive:
                self.unexpected_exits += 1
                rig.problems.append("the daemon was gone at the end of the load")
                await rig.kill_and_start(killed=False)
            self._sample_rss()
            await checks.sweep("final sweep")
            ctl = await rig.control()
            stats = await wait_idle(ctl, lambda: 1)
            final = stats if stats is not None else await ctl.stats()
            self.leaks = {"idle_reached": stats is not None, **idle_figures(final)}
            self.last_stats[self.daemon.incarnation] = final
            durable = await checks.disk_set("clean stop")
            self._sample_rss()
            await rig.close_ctl()
            self.exit_statuses.append(await self.daemon.stop())
            rig.note(f"SIGTERM: exit status {self.exit_statuses[-1]}")
            await self.daemon.start()
            if durable is not None:
                await checks.verify_durable(durable, "after SIGTERM")
            rig.note(f"clean restart: {len(durable or [])} blocks checked")
            await checks.sweep("clean restart sweep")
            await rig.close_ctl()
            self.exit_statuses.append(await self.daemon.stop())

    # -- the report -----------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        t, rig, checks = self.tally, self.rig, self.checks
        ops_total = sum(t.ops.values())
        minutes = []
        span = max(self.load_seconds, 1e-9)
        for start in range(0, int(span) + 1, 60):
            length = min(60.0, span - start)
            if length >= 1.0:
                count = sum(t.per_second[s] for s in range(start, start + 60))
                minutes.append(round(count / length, 1))
        return {
            "settings": {**asdict(self.s), "key_space": self.s.key_space},
            "load_seconds": round(self.load_seconds, 1),
            "operations": dict(t.ops),
            "blocks": dict(t.blocks),
            "ops_per_s": {"overall": round(ops_total / span, 1), "per_minute": minutes},
            "faults": {
                **{
                    kind: rig.injected[kind]
                    for kind in FAULT_KINDS
                    if kind != "disk_real_full" or self.real_full
                },
                "fuzz_connection": self.fuzzer.counts["connections"],
            },
            "fault_calls": self.fault_calls,
            "schedule": self.plan,
            "restarts": rig.restarts,
            "unexpected_exits": self.unexpected_exits,
            "fuzz": dict(self.fuzzer.counts),
            "hostile": self.hostile.report(),
            "fuzz_examples": self.fuzzer.examples,
            "bad_frames_sent": self.fuzzer.counts["bad_frames"],
            "client_errors": dict(t.errors),
            "daemon_counters": daemon_counters(self.last_stats),
            "wrong_blocks": t.wrong,
            "wrong_examples": t.wrong_examples,
            "aborted_store_visible": checks.aborted_visible,
            "durability": {**dict(checks.durability), "examples": checks.lost_examples},
            "durable_lost": checks.durability["lost"],
            "leaks": self.leaks,
            "rss_kib": rss_summary(self.rss, self.plan["warmup_s"]),
            "exit_statuses": self.exit_statuses,
            "problems": rig.problems,
            "timeline": rig.timeline,
        }
