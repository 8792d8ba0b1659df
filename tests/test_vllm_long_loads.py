"""Loads longer than what one request may hold (issue 35, point 1), against real daemons.

A prefix of more chunks than the connection's lease bound (half the daemon's CPU tier by
default), than the CPU tier itself, or than the tier's staging region is served whole and
byte exact, in rounds; a load that fails says so at the default log level (once per
interval, however many fail) and in the tier's figures.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.base", reason="vLLM is not installed: run scripts/setup_vllm"
)

from vllm.v1.kv_offload.base import LookupResult
from vllm_kit import ROW, ask, captured_logs, fill, keys, make_tier, primary_rows, run_job

from tierd.testing import daemon_config

HIT = LookupResult.HIT
# The daemon's own default bounds (the test config lifts them to the whole tier).
DEFAULT_LEASES = {"lease_blocks_per_connection": "50%", "lease_blocks_per_tenant": "75%"}
CHUNKS = 16  # a 12-block CPU tier: 6 per request, and 4 of them come from the disk tier


@pytest.mark.parametrize(
    ("regions", "staging_bytes"),
    [(True, 64 << 20), (True, 2 * 5 * ROW), (False, 64 << 20)],
    ids=["one-staging-round", "staging-rounds-of-5", "leases"],
)
async def test_a_prefix_past_the_lease_bound_is_served_whole(
    tmp_path, spawn, regions: bool, staging_bytes: int
) -> None:
    cfg = daemon_config(tmp_path, block_bytes=ROW, cpu_blocks=12, disk_blocks=64)
    cfg["limits"] = DEFAULT_LEASES
    daemon = await spawn(cfg)
    rows_a, rows_b = primary_rows(2 * CHUNKS), primary_rows(2 * CHUNKS)
    writer = make_tier(daemon.socket_path, rows_a, staging_bytes=staging_bytes)
    reader = make_tier(daemon.socket_path, rows_b, regions=regions, staging_bytes=staging_bytes)
    try:
        ks = keys("long", CHUNKS)
        fill(rows_a, range(CHUNKS), seed=35)
        assert run_job(writer, 1, ks, range(CHUNKS), load=False).success
        assert ask(reader, ks, "r") == [HIT] * CHUNKS
        targets = list(range(CHUNKS, 2 * CHUNKS))[::-1]
        result = run_job(reader, 2, ks, targets, load=True)
        assert result.success and result.transfer_bytes == CHUNKS * ROW
        assert np.array_equal(rows_b[targets], rows_a[:CHUNKS])
        figures = reader.get_stats().reduce()
        assert figures["vllm:kv_offload_tierd_blocks_loaded"] == CHUNKS
        assert figures.get("vllm:kv_offload_tierd_failed_jobs", 0) == 0
    finally:
        writer.shutdown()
        reader.shutdown()


async def test_a_failed_load_is_a_warning_and_a_figure(tmp_path, spawn) -> None:
    daemon = await spawn(daemon_config(tmp_path, block_bytes=ROW))
    rows = primary_rows(8)
    tier = make_tier(daemon.socket_path, rows)
    try:
        ks = keys("gone", 2)
        with captured_logs() as logs:
            for job_id in (1, 2, 3):  # never stored: the daemon cannot serve them
                assert not run_job(tier, job_id, ks, [0, 1], load=True).success
        failed = [line for line in logs if line["event"] == "tierd load failed"]
        assert len(failed) == 1  # rate-limited: one line for a burst
        assert failed[0]["log_level"] == "warning"
        assert (failed[0]["keys"], failed[0]["loaded"]) == (2, 0)
        figures = tier.get_stats().reduce()
        assert figures["vllm:kv_offload_tierd_failed_jobs"] == 3
    finally:
        tier.shutdown()
