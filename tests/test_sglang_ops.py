"""tierd under SGLang's own code, continued (issue 35): SGLang's L3 clear, tierd's lines
in SGLang's logging, an extra config from an @file, ``tierd namespaces`` after memfd
stores, calls after SGLang's detach, and the install SGLang imports tierd from.

The engines are tests/sglang_kit/driver.py processes, as in tests/test_sglang.py (whose
daemon config and engine pair this module shares).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from sglang_kit.engines import (
    DRIVER,
    EXTRA,
    ROOT,
    SGLANG_PYTHON,
    Engines,
    missing_reason,
    sglang_site,
    tierd_spec,
)
from sglang_kit.shared import PAGES, config, loaded_all, namespace_row

REASON = missing_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def tierd_lines(engines: Engines, name: str, level: str) -> list[str]:
    """What tierd logged at ``level`` through the logging SGLang configured."""
    return [text for lvl, text in engines.stats(name)["tierd_logs"] if lvl == level]


async def test_clear_removes_the_namespaces_pages_for_every_engine_and_says_so(
    pair: Any, sglang_daemon: Any
) -> None:
    """SGLang answers POST /hicache/storage-backend/clear with "cleared" whatever the
    backend does: tierd must then serve none of the namespace's pages."""
    a, b = pair
    sock = sglang_daemon.socket_path
    ns = a.open("c", tierd_spec(sock, allocator="shm"))["namespace"]
    b.open("c", tierd_spec(sock))
    b.open("c-other", tierd_spec(sock, model="other-model"))
    # SGLang's default level shows tierd's start-up facts, the namespace among them.
    assert any(f"namespace={ns}" in line for line in tierd_lines(a, "c", "INFO"))
    assert a.write("c", seed=60, pages=PAGES)["stored_pages"] == PAGES
    assert b.write("c-other", seed=61, pages=8)["stored_pages"] == 8
    assert loaded_all(b.read("c", seed=60, pages=PAGES), PAGES)

    assert a.ask("clear", "c")["cleared"]  # what SGLang tells the operator
    assert b.read("c", seed=60, pages=PAGES)["hit_pages"] == 0
    assert a.read("c", seed=60, pages=PAGES)["hit_pages"] == 0
    row = await namespace_row(sock, ns)
    assert sum(row["blocks"].values()) == 0, row
    assert loaded_all(b.read("c-other", seed=61, pages=8), 8)  # another namespace's
    assert any(f"cleared: namespace={ns}" in line for line in tierd_lines(a, "c", "INFO"))

    # A sglang_daemon that cannot clear: SGLang still says "cleared", tierd says why not.
    sglang_daemon.signal(signal.SIGKILL)
    await sglang_daemon.wait()
    a.ask("clear", "c")
    assert any("not cleared" in line for line in tierd_lines(a, "c", "WARNING"))
    for engines, name in [(a, "c"), (b, "c"), (b, "c-other")]:
        assert engines.stats(name)["sglang_errors"] == 0
        engines.ask("close", name)


async def test_an_allocator_sglang_ignores_is_said_once_at_warning(
    tmp_path: Path, spawn: Any, pair: Any
) -> None:
    """``"allocator": "shm"`` in an @file extra config: SGLang's allocator choice never
    reads it (only inline JSON), so the memfd path is off; the backend says so once."""
    a, _ = pair
    daemon = await spawn(config(tmp_path))
    sock = daemon.socket_path
    extra = {**EXTRA, "allocator": "shm", "socket": sock}
    path = tmp_path / "tierd.json"
    path.write_text(json.dumps(extra))
    before = len(tierd_lines_all(a))
    assert not a.open("at-file", tierd_spec(sock, launch_extra=f"@{path}"))["memfd"]
    inline = a.open("inline", tierd_spec(sock, launch_extra=json.dumps(extra)))
    assert inline["memfd"]  # the same config inline: SGLang allocates a memfd
    said = [text for lvl, text in tierd_lines_all(a)[before:] if "allocator" in text]
    assert len(said) == 1 and "inline" in said[0], said
    assert tierd_lines_all(a)[before:].count(["WARNING", said[0]]) == 1
    assert a.write("at-file", seed=65, pages=8)["stored_pages"] == 8  # copies still work
    assert loaded_all(a.read("inline", seed=65, pages=8), 8)
    for name in ("at-file", "inline"):
        a.ask("close", name)


def tierd_lines_all(engines: Engines) -> list[list[str]]:
    """Every ``[level, line]`` tierd logged in the engines' process (its last 200)."""
    return list(engines.ask("log")["tierd_logs"])


async def test_namespaces_count_memfd_stores_and_calls_after_close_miss(
    pair: Any, sglang_daemon: Any
) -> None:
    a, b = pair
    sock = sglang_daemon.socket_path
    ns = a.open("m", tierd_spec(sock, allocator="shm"))["namespace"]
    assert a.stats("m")["memfd"]
    b.open("d", tierd_spec(sock))
    assert a.write("m", seed=70, pages=20)["stored_pages"] == 20
    assert a.write("m", seed=71, pages=20)["stored_pages"] == 20
    assert b.write("d", seed=72, pages=20)["stored_pages"] == 20
    row = await namespace_row(sock, ns)
    assert row["stored_blocks"] == 60, row

    # SGLang's detach closes the backend; a call that comes after it is a miss.
    answers = a.ask("close_and_call", "m")
    assert answers == {
        "batch_exists": 0,
        "batch_get_v1": [False],
        "batch_set_v1": [False],
        "exists": False,
        "clear": False,
        "close": None,
    }, answers
    b.ask("close", "d")


def test_sglang_run_from_the_checkouts_parent_imports_tierd(tmp_path: Path) -> None:
    """A checkout named ``tierd``, and SGLang started in its parent directory (``python
    -m sglang.launch_server`` puts the working directory first on sys.path): the
    backend must import from .venv-sglang's install, with no PYTHONPATH."""
    (tmp_path / "tierd").symlink_to(ROOT, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    check = (
        "import runpy, sys; sys.argv = ['driver', '--check']; "
        f"runpy.run_path({str(DRIVER)!r}, run_name='__main__')"
    )
    done = subprocess.run(
        [str(SGLANG_PYTHON), "-W", "ignore", "-c", check],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tierd.integrations.sglang import" in done.stdout


def test_the_docs_name_the_file_backends_keys_as_sglang_reads_them() -> None:
    docs = (ROOT / "docs" / "sglang.md").read_text()
    section = docs.split("## Compared with SGLang's `file` backend", 1)[1].split("\n## ", 1)[0]
    evictor = sglang_site() / "sglang" / "srt" / "mem_cache" / "storage" / "file"
    source = (evictor / "lru_file_evictor.py").read_text()
    keys = re.findall(r"`(max_size\w*|min_free\w*)`", section)
    assert keys
    for key in keys:
        assert f'_cfg("{key}"' in source, key
