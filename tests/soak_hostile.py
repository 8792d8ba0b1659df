"""The soak's misbehaving clients and its real full file system.

- :class:`Hostile` runs, beside the honest workers, one attacker of each kind in turn
  until the load stops: a msgpack bomb (a frame of 200,000 empty arrays), a client
  that pipelines ``get`` requests and never reads, a slowloris (half a frame, then
  silence), idle sockets that never say hello, and partial-frame churn (four
  connections each send half of a 192 KiB frame and close at once: the daemon must free
  those bytes on the close, which the report's RSS shows). Each attack must end the way the
  daemon's guards promise (``bad_frame`` reply, closed connection): what happened is
  counted in ``counts`` and any other outcome is an ``unexpected`` entry in the report.
- :class:`RealFullDisk` mounts a small tmpfs as one of the disk tier's directories (root
  only) and fills it during episodes, so the daemon meets a real ENOSPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from tierd.control.protocol import HEADER, PROTOCOL_VERSION, FrameDecoder, encode

# The daemon's guards, set short in the soak's config so that attacks end within a run.
GUARD_LIMITS = {
    "hello_timeout_s": 2,
    "frame_deadline_s": 3,
    "output_stall_s": 2,
    "output_buffer_bytes": 1 << 20,
}
_WAIT_S = 30.0  # safety net for one attack; the guards act within a few seconds
_ATTACK_PAUSE_S = 0.5
_RESTART_GRACE_S = 10.0  # how long a killed daemon may take to be counted as restarted
# How long a non-reader (or a silent socket) stays silent before it looks for the close:
# several times the guards' limits, so that a loaded machine has time to fill the buffers.
_SKIP_S = 5 * max(GUARD_LIMITS["output_stall_s"], GUARD_LIMITS["hello_timeout_s"])
ATTACKS = ("bomb", "non_reader", "slowloris", "idle", "partial_churn")


class Hostile:
    """One attack at a time, in a seeded order, until ``stop`` is set."""

    def __init__(
        self,
        path: Callable[[], str],
        namespace: str,
        incarnation: Callable[[], int],
        turn: Callable[[], contextlib.AbstractAsyncContextManager[None]],
    ) -> None:
        self._turn = turn  # the campaign's gate: checkpoints wait for the attack running
        self._path = path
        self._namespace = namespace
        self._incarnation = incarnation  # changes when the daemon was killed and restarted
        self._began = 0
        self._odd_now: list[str] = []
        self.counts: Counter[str] = Counter()
        self.unexpected: list[str] = []

    async def run(self, stop: asyncio.Event) -> None:
        turn = 0
        while not stop.is_set():
            attack = ATTACKS[turn % len(ATTACKS)]
            turn += 1
            self._began = self._incarnation()
            self._odd_now = []
            try:
                async with self._turn(), asyncio.timeout(_WAIT_S):
                    await getattr(self, f"_{attack}")()
            except (ConnectionError, FileNotFoundError, ConnectionRefusedError):
                self.counts["daemon_away"] += 1  # restarting: not the attack's outcome
            except TimeoutError:
                self._odd_now.append(f"{attack}: no end within {_WAIT_S} s")
            await self._judge()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _ATTACK_PAUSE_S)

    def _odd(self, what: str) -> None:
        self._odd_now.append(what)

    async def _judge(self) -> None:
        """An odd end counts only if the same daemon ran the whole attack: one killed
        and restarted meanwhile (the campaign's SIGKILLs) ends connections its own way."""
        if not self._odd_now:
            return
        await asyncio.sleep(_RESTART_GRACE_S)  # a kill's restart shows by then
        if self._incarnation() != self._began:
            self.counts["daemon_away"] += 1
            return
        self.counts["unexpected"] += 1
        if len(self.unexpected) < 20:
            self.unexpected.extend(self._odd_now)

    async def _open(self, hello: bool = True) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_unix_connection(self._path())
        if hello:
            writer.write(
                encode(
                    {
                        "id": 1,
                        "op": "hello",
                        "version": PROTOCOL_VERSION,
                        "namespace": self._namespace,
                    }
                )
            )
            first = await _replies(reader, 1)
            if not first or not first[0].get("ok"):
                writer.close()
                raise ConnectionError(f"hello refused: {first}")
        return reader, writer

    async def _bomb(self) -> None:
        count = 200_000  # under the soak's frame limit: the decoder's limits must act
        head = msgpack.packb({"id": 2, "op": "health", "x": []})
        body = head[:-1] + b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count
        frame = HEADER.pack(len(body)) + body
        await self._refused("bomb", frame, ("bad_frame", "frame_too_large"), "bomb_refused")

    async def _non_reader(self) -> None:
        """Pipelines a thousand ``metrics`` requests (megabytes of replies) and never
        reads: the daemon stops reading, then closes the connection after the stall."""
        reader, writer = await self._open()
        try:
            writer.write(b"".join(encode({"id": 10 + i, "op": "metrics"}) for i in range(1000)))
            if await _closed(reader, skip=True):
                self.counts["non_reader_closed"] += 1
            else:
                self._odd("non-reader: the connection stayed open")
        finally:
            writer.close()

    async def _slowloris(self) -> None:
        frame = HEADER.pack(1 << 16) + b"\x00" * 1000
        await self._refused("slowloris", frame, ("bad_frame",), "slowloris_closed", close=True)

    async def _refused(
        self, name: str, frame: bytes, errors: tuple[str, ...], counter: str, close: bool = False
    ) -> None:
        """Sends ``frame`` on a fresh connection: the daemon must answer one of ``errors``
        (and then close the connection, with ``close``); that counts under ``counter``."""
        reader, writer = await self._open()
        try:
            writer.write(frame)
            replies = await _replies(reader, 1)
            refused = bool(replies) and replies[0].get("error") in errors
            if refused and (not close or await _closed(reader)):
                self.counts[counter] += 1
            else:
                self._odd(f"{name} answered {replies[:1]}")
        finally:
            writer.close()

    async def _idle(self) -> None:
        opened = [await self._open(hello=False) for _ in range(8)]
        try:
            closed = await asyncio.gather(*(_closed(reader, skip=True) for reader, _ in opened))
            self.counts["idle_closed"] += sum(closed)
            if not all(closed):
                self._odd(f"idle: {closed.count(False)} of 8 silent sockets stayed open")
        finally:
            for _, writer in opened:
                writer.close()

    async def _partial_churn(self) -> None:
        opened = [await self._open() for _ in range(4)]
        for _, writer in opened:
            # Under the soak's smallest max_frame_bytes (256 KiB): a frame, not a refusal.
            writer.write(HEADER.pack(192 << 10) + b"\x00" * (96 << 10))
        for _, writer in opened:
            await writer.drain()
            writer.close()
        self.counts["partial_churn"] += 1

    def report(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "unexpected": self.unexpected}


async def _replies(reader: asyncio.StreamReader, count: int) -> list[dict[str, Any]]:
    decoder = FrameDecoder(1 << 30)
    out: list[dict[str, Any]] = []
    while len(out) < count:
        data = await reader.read(1 << 16)
        if not data:
            break
        out += decoder.feed(data)
    return out


async def _closed(reader: asyncio.StreamReader, *, skip: bool = False) -> bool:
    """Whether the daemon closes the connection (reading, and dropping, what it sends
    when ``skip``; a non-reader reads nothing until the stall limit has passed)."""
    if skip:
        await asyncio.sleep(_SKIP_S)
    while True:
        try:
            data = await reader.read(1 << 20)
        except ConnectionError:
            return True
        if not data:
            return True


# -- a real full file system ------------------------------------------------------------------


class RealFullDisk:
    """A tmpfs of ``size`` bytes mounted at ``workdir/fullfs`` (root only: else
    :attr:`directory` is None and the campaign runs without it)."""

    def __init__(self, workdir: Path, size: int) -> None:
        self.directory: Path | None = None
        self.fills = 0
        if os.geteuid() != 0:
            return
        target = workdir / "fullfs"
        target.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(target)],
            capture_output=True,
            check=False,
        )
        if done.returncode == 0:
            self.directory = target

    def fill(self) -> bool:
        """Write a filler until the file system is full; whether it got full."""
        if self.directory is None:
            return False
        chunk = b"\xee" * (64 << 10)
        fd, _ = tempfile.mkstemp(prefix="filler-", dir=self.directory)
        try:
            while True:
                os.write(fd, chunk)
        except OSError:
            self.fills += 1
            return True
        finally:
            os.close(fd)

    def release(self) -> None:
        if self.directory is None:
            return
        for name in os.listdir(self.directory):
            if name.startswith("filler-"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.directory / name)

    def unmount(self) -> None:
        if self.directory is not None:
            subprocess.run(["umount", "-l", str(self.directory)], capture_output=True, check=False)
            self.directory = None
