"""The test side of tests/sglang_kit/driver.py: SGLang "engines" in processes of
.venv-sglang's python (scripts/setup_sglang), spoken to over pipes.

SGLang pins its own torch and transformers, so it lives in a venv of its own; pytest runs
in .venv and starts the engines as child processes (a writer and a reader are two
processes anyway, as two SGLang engines would be).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).resolve().parent / "driver.py"
SGLANG_PYTHON = Path(
    os.environ.get("TIERD_SGLANG_PYTHON", ROOT / ".venv-sglang" / "bin" / "python")
)
ANSWER_TAG = "@@answer "  # driver.py's answer lines; the rest is log
ANSWER_S = 300.0  # safety net: importing SGLang on a busy 2-core machine takes a minute

# The documented extra config (docs/sglang.md), less the socket.
EXTRA = {
    "backend_name": "tierd",
    "module_path": "tierd.integrations.sglang",
    "class_name": "TierdHiCache",
    "interface_v1": 1,
}
GEOMETRY = {"page": 4, "layers": 3, "heads": 2, "head_dim": 8, "dtype": "float16"}


def sglang_site() -> Path:
    """The site-packages directory of the SGLang venv (SGLang's sources)."""
    return next((SGLANG_PYTHON.parent.parent / "lib").glob("python3*/site-packages"))


def missing_reason() -> str | None:
    """Why SGLang engines cannot run here, or None."""
    if not SGLANG_PYTHON.is_file():
        return f"SGLang is not installed ({SGLANG_PYTHON} missing): run scripts/setup_sglang"
    return None


def page_bytes(geometry: dict[str, Any] | None = None) -> int:
    """One page of an MHA host pool of ``geometry``: the daemon's block_bytes."""
    g = {**GEOMETRY, **(geometry or {})}
    itemsize = {"float16": 2, "bfloat16": 2, "float32": 4}[g["dtype"]]
    return 2 * g["layers"] * g["heads"] * g["head_dim"] * itemsize * g["page"]


def tierd_spec(socket_path: str, **over: Any) -> dict[str, Any]:
    """A driver spec for SGLang's dynamic backend loading tierd with the documented JSON."""
    extra = {**EXTRA, "socket": socket_path, **over.pop("extra", {})}
    spec = {**GEOMETRY, "backend": "dynamic", "layout": "page_first", "host_pages": 160}
    return {**spec, "extra": extra, **over}


def file_spec(directory: Path, **over: Any) -> dict[str, Any]:
    """A driver spec for SGLang's own ``file`` backend."""
    spec = {**GEOMETRY, "backend": "file", "layout": "page_first", "host_pages": 160}
    return {**spec, "extra": {"file_storage_path": str(directory)}, **over}


class Engines:
    """One driver process: engines by name, commands answered in order."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
        child_env.update({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})})
        self.proc = subprocess.Popen(
            [str(SGLANG_PYTHON), str(DRIVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env,
            cwd=str(ROOT),
        )
        self._answers: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        started = self._answer()
        if not started.get("started"):
            raise AssertionError(f"the SGLang driver did not start: {started}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(ANSWER_TAG):
                self._answers.put(line[len(ANSWER_TAG) :])
            else:  # a log line
                self._stderr.append(line)
        self._answers.put(None)

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)
            del self._stderr[:-200]

    def _answer(self) -> dict[str, Any]:
        try:
            line = self._answers.get(timeout=ANSWER_S)
        except queue.Empty:
            raise AssertionError(f"no answer from the SGLang driver:\n{self.stderr()}") from None
        if line is None:
            raise AssertionError(f"the SGLang driver exited:\n{self.stderr()}")
        return dict(json.loads(line))

    def stderr(self) -> str:
        return "".join(self._stderr[-60:])

    def ask(self, op: str, engine: str = "main", **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "engine": engine, **fields}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        if "error" in answer:
            raise AssertionError(f"{op} failed in the driver: {answer['error']}\n{self.stderr()}")
        return answer

    def open(self, engine: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self.ask("open", engine, spec=spec)

    def write(
        self, engine: str, seed: int, pages: int, start: int = 0, **more: Any
    ) -> dict[str, Any]:
        return self.ask("write", engine, seed=seed, pages=pages, start=start, **more)

    def read(
        self, engine: str, seed: int, pages: int, reuse_s: float = 0.0, **more: Any
    ) -> dict[str, Any]:
        return self.ask("read", engine, seed=seed, pages=pages, reuse_s=reuse_s, **more)

    def stopped(self) -> bool:
        """Whether the driver process is stopped (SIGSTOP: ``T`` in /proc)."""
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")

    def stats(self, engine: str) -> dict[str, Any]:
        return self.ask("stats", engine)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a test that failed while it was stopped
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
