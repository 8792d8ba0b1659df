"""LMCache against a tierd daemon: where LMCache's python is (and why the tests skip without
it), its driver process (tests/lmcache_driver.py) and what it answers, and a daemon config
for it."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from pathlib import Path
from typing import Any

from tierd.client import Client
from tierd.testing import daemon_config

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "lmcache_driver.py"


LMCACHE_PYTHON = Path(
    os.environ.get("TIERD_LMCACHE_PYTHON", ROOT / ".venv-lmcache" / "bin" / "python")
)


REASON = (
    None
    if LMCACHE_PYTHON.is_file()
    else f"LMCache is not installed ({LMCACHE_PYTHON} missing): run scripts/setup_lmcache"
)


ANSWER_TAG = "@@answer "
ANSWER_S = 300.0  # safety net: importing LMCache and torch on a busy 2-core machine
BLOCK = 16384
LIVENESS_S = 15.0  # a task on a stopped daemon finishes long before this (30 x deadline)
MODEL = "org/model-7b"


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
    env.update({"PYTHONUNBUFFERED": "1", "LMCACHE_DISABLE_BANNER": "1"})
    return env


class Lmcache:
    """One LMCache process running tests/lmcache_driver.py; commands answered in order."""

    def __init__(self, spec: str, block: int = BLOCK, *, in_loop: bool = False) -> None:
        extra = ["--in-loop"] if in_loop else []
        self.proc = subprocess.Popen(
            [str(LMCACHE_PYTHON), str(DRIVER), spec, str(block), MODEL, *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_env(),
            cwd="/",
        )
        self._answers: queue.Queue[str | None] = queue.Queue()
        self._log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        assert self._answer().get("started")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(ANSWER_TAG):
                self._answers.put(line[len(ANSWER_TAG) :])
            else:
                self._log.append(line)
        self._answers.put(None)

    def _answer(self) -> dict[str, Any]:
        try:
            line = self._answers.get(timeout=ANSWER_S)
        except queue.Empty:
            raise AssertionError(f"no answer from the LMCache driver:\n{self.log()}") from None
        if line is None:
            raise AssertionError(f"the LMCache driver exited:\n{self.log()}")
        return dict(json.loads(line))

    def log(self) -> str:
        return "".join(self._log[-80:])

    def ask(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def store(self, seed: int, count: int) -> dict[str, Any]:
        return self.ask("store", seed=seed, count=count)

    def load(self, seed: int, count: int) -> dict[str, Any]:
        return self.ask("load", seed=seed, count=count)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def config(tmp_path: Path, block: int = BLOCK, **over: Any) -> dict[str, Any]:
    return daemon_config(
        tmp_path, block_bytes=block, **{"cpu_blocks": 64, "disk_blocks": 256, **over}
    )


def all_identical(answer: dict[str, Any], count: int) -> bool:
    return bool(answer.get("finished")) and answer.get("identical") == answer.get("found") == count


async def delete_from(socket_path: str, namespace: str, raw: list[bytes]) -> dict[str, Any]:
    client = await Client.connect(socket_path, namespace=namespace)
    try:
        return await client.delete(raw)
    finally:
        await client.close()
