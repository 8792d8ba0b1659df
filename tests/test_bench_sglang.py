"""``scripts/bench sglang`` (bench/sglang.py) runs end to end, in its smallest size, with
``TIERD_BENCH_DIR`` set: the bench's own variable, which its daemons must not be handed
(``tierd serve`` refuses a ``TIERD_*`` variable that is not a setting)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from sglang_kit.engines import SGLANG_PYTHON, missing_reason

ROOT = Path(__file__).resolve().parent.parent
REASON = missing_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
RUN_S = 600  # safety net: importing SGLang on a busy 2-core machine takes a minute


def test_the_sglang_bench_runs_with_its_directory_set(tmp_path: Path) -> None:
    where = tmp_path / "bench-dir"
    where.mkdir(mode=0o700)
    done = subprocess.run(
        [str(ROOT / "scripts" / "bench"), "sglang", "--pages-per-call", "2", "--reps", "1"],
        capture_output=True,
        text=True,
        timeout=RUN_S,
        check=False,
        env={**os.environ, "PYTHON": str(SGLANG_PYTHON), "TIERD_BENCH_DIR": str(where)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| tierd ")]
    assert len(rows) == 10, done.stdout  # five daemons, each with and without the memfd
    assert all(row.endswith("| yes |") for row in rows), done.stdout  # byte for byte
    assert list(where.iterdir()) == []  # nothing of the run left behind there
