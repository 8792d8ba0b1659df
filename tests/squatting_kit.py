"""A socket squatted by another user: an impostor process of user nobody that binds the
daemon's socket path first (the ``impostor`` fixture)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# Binds and listens as ``nobody`` (SO_PEERCRED reports the listener's credentials at
# listen time), answers the first connection with a hello reply that names a pool, and
# records how many bytes the client sent.
_IMPOSTOR = """
import os, socket, sys, msgpack, struct
path, record = sys.argv[1], sys.argv[2]
os.setgid(65534); os.setuid(65534)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.bind(path); sock.listen(1)
print("ready", flush=True)
conn, _ = sock.accept()
conn.settimeout(3)
reply = msgpack.packb({"id": 1, "ok": True, "server": "tierd 0", "protocol": 1,
                       "block_bytes": 4096, "pool": None, "tiers": [], "entry": "cpu"})
try:
    conn.sendall(struct.pack(">I", len(reply)) + reply)
except OSError:
    pass  # the client hung up at once
got = b""
try:
    while True:
        data = conn.recv(65536)
        if not data:
            break
        got += data
except OSError:
    pass
with open(record, "w") as f:
    f.write(str(len(got)))
"""


@dataclass
class Impostor:
    path: Path  # the socket it bound first
    record: Path  # how many bytes it received, once it has exited
    proc: subprocess.Popen[str]

    async def received(self) -> int:
        assert await asyncio.to_thread(self.proc.wait, 30) == 0
        return int(await asyncio.to_thread(self.record.read_text))


@pytest.fixture
def impostor() -> Iterator[Impostor]:
    """A process of user ``nobody`` listening on a socket path, ready."""
    directory = Path(tempfile.mkdtemp(prefix="tierd-squat-", dir="/tmp"))
    os.chmod(directory, 0o777)  # the impostor may create its socket and its record
    path, record = directory / "tierd.sock", directory / "received"
    proc = subprocess.Popen(
        [sys.executable, "-c", _IMPOSTOR, str(path), str(record)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        yield Impostor(path, record, proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(directory, ignore_errors=True)
