"""The lookup deadline of tierd's SGLang backend counts the engine's own time (issue 60,
item 10; no SGLang needed: tests/test_sglang_busy.py runs SGLang's controller on a
saturated node)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tierd.integrations.sglang import page_jobs as sglang_jobs
from tierd.integrations.sglang.page_jobs import PageJobs, cpu_demand

CPUS = len(os.sched_getaffinity(0))


def loadavg(tmp_path: Path, text: str) -> str:
    path = tmp_path / "loadavg"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("minute", "running", "demand"),
    [
        (0.2, 1, 1.0),  # idle: the reader alone runs
        (0.5 * CPUS, 1, 1.0),  # a CPU to spare
        (4.0 * CPUS, 1, 4.0),  # busy over the last minute, quiet this instant
        (0.1, 8 * CPUS + 1, 8.0),  # a burst now (the reader not counted)
    ],
)
def test_cpu_demand_is_the_busier_of_now_and_the_last_minute_over_the_cpus(
    tmp_path: Path, minute: float, running: int, demand: float
) -> None:
    text = f"{minute:.2f} 0.00 0.00 {running}/500 4242\n"
    assert cpu_demand(loadavg(tmp_path, text)) == pytest.approx(demand)


@pytest.mark.parametrize("text", ["", "garbage\n", "1.0 1.0 1.0 x/5 1\n"])
def test_cpu_demand_unreadable_is_no_stretch(tmp_path: Path, text: str) -> None:
    assert cpu_demand(loadavg(tmp_path, text)) == 1.0
    assert cpu_demand(str(tmp_path / "missing")) == 1.0


@pytest.mark.parametrize(
    ("demand", "lookup_s", "job_s", "deadline"),
    [
        (1.0, 0.1, 2.0, 0.1),  # an idle node: the deadline as configured
        (9.0, 0.1, 2.0, 0.9),  # 16 busy loops on 2 CPUs
        (40.0, 0.1, 2.0, 2.0),  # never past the job deadline
        (40.0, 3.0, 2.0, 3.0),  # nor shorter than the lookup deadline
    ],
)
def test_a_lookups_deadline_is_stretched_by_the_demand_up_to_the_job_deadline(
    monkeypatch: pytest.MonkeyPatch, demand: float, lookup_s: float, job_s: float, deadline: float
) -> None:
    monkeypatch.setattr(sglang_jobs, "cpu_demand", lambda: demand)
    jobs = SimpleNamespace(lookup_deadline_s=lookup_s, job_deadline_s=job_s)
    assert PageJobs.lookup_deadline(jobs) == pytest.approx(deadline)  # type: ignore[arg-type]
