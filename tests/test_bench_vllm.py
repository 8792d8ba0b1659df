"""``scripts/bench vllm``'s secondary-tier figures, without vLLM: the worker's clock
(``TierClock`` in bench/vllm_worker.py) times a tier's calls and jobs from outside, and the
report (bench/vllm.py) turns synthetic samples into per-request medians with tierd's
ratio to vLLM's fs tier, beside the TTFT rows."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import vllm as bench  # noqa: E402
from bench.vllm_worker import TierClock  # noqa: E402


class Lookup(Enum):  # vLLM's LookupResult, by name
    HIT = 1
    MISS = 2
    RETRY = 3


@dataclass
class Job:  # vLLM's TransferJob, the fields the clock reads
    job_id: int
    keys: tuple[bytes, ...]


@dataclass
class Result:  # vLLM's JobResult
    job_id: int
    success: bool
    transfer_time: float | None


@dataclass
class Request:  # vLLM's ReqContext
    req_id: str


class FakeTier:
    """A secondary tier whose load takes ``load_s`` in ``submit_load`` (as tierd's) and
    reports it as its transfer_time; a lookup answers RETRY once, then HIT."""

    def __init__(self, load_s: float) -> None:
        self.load_s = load_s
        self.done: list[Result] = []
        self.asked: set[bytes] = set()

    def lookup(self, key: bytes, req_context: Request) -> Lookup:
        if key in self.asked:
            return Lookup.HIT
        self.asked.add(key)
        return Lookup.RETRY

    def submit_load(self, job: Job) -> None:
        time.sleep(self.load_s)
        self.done.append(Result(job.job_id, True, self.load_s))

    def submit_store(self, job: Job) -> None:
        self.done.append(Result(job.job_id, True, None))

    def get_finished_jobs(self) -> Any:
        done, self.done = self.done, []
        return iter(done)  # an iterable, not a list: the clock must not consume it for vLLM

    def on_schedule_end(self, context: object) -> None:
        return


def test_the_clock_times_a_tiers_jobs_and_calls_from_outside() -> None:
    tier = FakeTier(load_s=0.02)
    clock = TierClock([tier])
    request = Request("r1")
    assert tier.lookup(b"k1", request) is Lookup.RETRY
    time.sleep(0.01)
    assert tier.lookup(b"k1", request) is Lookup.HIT
    tier.submit_load(Job(1, (b"k1", b"k2")))
    tier.submit_store(Job(2, (b"k3",)))
    time.sleep(0.01)  # the manager polls a step later
    finished = list(tier.get_finished_jobs())
    assert [r.job_id for r in finished] == [1, 2]  # vLLM still gets every result
    figures = clock.figures()
    assert (figures["loads"], figures["load_keys"], figures["load_failed"]) == (1, 2, 0)
    assert (figures["stores"], figures["store_keys"]) == (1, 1)
    assert figures["load_tier_s"] == pytest.approx(0.02)  # what the tier reported
    assert 0.03 <= figures["load_wall_s"] < 0.5  # submit to the poll that saw it done
    assert figures["load_span_s"] == pytest.approx(figures["load_wall_s"])
    assert figures["store_tier_s"] == 0.0  # reported none
    assert 0.02 <= figures["sched_s"] < figures["load_wall_s"]  # the load blocked the caller
    assert 0.01 <= figures["lookup_wait_s"] < 0.5 and figures["lookup_requests"] == 1
    clock.clear()
    assert clock.figures()["loads"] == 0 and clock.figures()["sched_s"] == 0.0


def tier(load_ms: float, tier_ms: float, keys: int, requests: int) -> dict[str, Any]:
    """The worker's figures of one generate whose ``requests`` loads took ``load_ms`` each."""
    return {
        "sched_s": 0.001 * requests,
        "loads": requests,
        "load_keys": keys * requests,
        "load_failed": 0,
        "load_wall_s": load_ms / 1000 * requests,
        "load_span_s": load_ms / 1000 * requests,
        "load_tier_s": tier_ms / 1000 * requests,
        "stores": 0,
        "store_keys": 0,
        "store_failed": 0,
        "store_wall_s": 0.0,
        "store_span_s": 0.0,
        "store_tier_s": 0.0,
        "lookup_wait_s": 0.002 * requests,
        "lookup_requests": requests,
    }


def sample(fs_ms: float, tierd_ms: float) -> bench.Sample:
    out: bench.Sample = {}
    for shape in bench.SHAPES:
        s = shape.name
        out[s, "plain", "cold"] = (1.0, [0], None)
        out[s, "plain", "burst8"] = (8.0, [0] * 8, None)
        out[s, "fs", "cold"] = (1.0, [0], tier(0, 0, 0, 1) | {"stores": 1})
        out[s, "fs", "served"] = (0.1, [2048], tier(fs_ms, fs_ms - 1, 64, 1))
        out[s, "tierd", "served"] = (0.05, [2048], tier(tierd_ms, tierd_ms - 1, 64, 1))
        out[s, "fs", "served8"] = (0.4, [2048] * 8, tier(fs_ms, fs_ms - 1, 64, 8))
        out[s, "tierd", "served8"] = (0.4, [2048] * 8, tier(tierd_ms, tierd_ms - 1, 64, 8))
    return out


def test_the_report_gives_the_tiers_loads_per_served_request_beside_ttft(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = bench.summarize([sample(20, 6), sample(30, 9), sample(10, 12)])
    rows = result["8L-b32"]
    fs, tierd = rows["fs.served"]["tier"], rows["tierd.served"]["tier"]
    assert fs["load_job_ms"] == 20.0 and fs["load_job_ms_runs"] == [20.0, 30.0, 10.0]
    assert tierd["load_job_ms"] == 9.0 and tierd["load_tier_ms"] == 8.0
    assert tierd["load_keys"] == 64 and tierd["load_failed"] == 0
    assert tierd["load_span_pct"] == pytest.approx(18.0)  # 9 ms of a 50 ms TTFT
    assert tierd["ratio_to_fs"]["load_job_ms"] == pytest.approx(0.45)
    assert tierd["ratio_to_fs"]["load_tier_ms"] == pytest.approx(8 / 19, abs=1e-3)
    assert "ratio_to_fs" not in fs
    eight = rows["tierd.served8"]["tier"]
    assert eight["load_job_ms"] == 9.0  # per served request of the eight
    assert eight["load_span_ms"] == 72.0 and eight["load_keys"] == 512
    assert rows["tierd.served"]["ratio_to_fs"] == 0.5  # TTFT rows kept
    assert rows["fs.served8"]["ratio_to_plain"] == 0.05
    assert "tier" not in rows["plain.cold"]
    bench.print_table(result, argparse.Namespace(prompt_tokens=2064, runs=3))
    out = capsys.readouterr().out
    assert "fs.served8" in out and "load_job" in out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("tierd.served ")]
    assert len(lines) == 4  # per shape, the TTFT row, then the tier's row
    assert "(0.45x)" in lines[2] and "  64  18.0%" in lines[2]
