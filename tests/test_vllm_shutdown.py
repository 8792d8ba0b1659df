"""After ``shutdown()`` the tier exports nothing of vLLM's memory (issue 35, point 4).

vLLM's CPU tier is a shared mapping (``SharedOffloadRegion``); at shutdown vLLM releases
the memoryview it gave its tiers, then closes the ``mmap`` and logs ``Failed to close
mmap_obj ... BufferError`` when any view of it is still exported. The tier, its direct
channel and its staged copies all view those rows: after ``shutdown()`` none may, even
while vLLM still holds the tier object.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.base", reason="vLLM is not installed: run scripts/setup_vllm"
)

from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm_kit import ROW, fill, keys, offloading_spec, run_job

from tierd.integrations.vllm import TierdSecondaryTier
from tierd.testing import daemon_config

CHUNKS = 8


def tier_over(
    mapping: mmap.mmap, socket_path: str, **config: object
) -> tuple[TierdSecondaryTier, memoryview]:
    """The tier as vLLM builds it over its region: a memoryview of an array over the
    mapping (``create_kv_memoryview``), which vLLM's manager keeps and releases at
    shutdown before its region closes the mapping."""
    view = memoryview(np.frombuffer(mapping, dtype=np.int8).reshape(CHUNKS, ROW))
    tier = SecondaryTierFactory.create_secondary_tier(
        {
            "type": "TierdSecondaryTier",
            "module_path": "tierd.integrations.vllm",
            "socket": socket_path,
            **config,
        },
        view,
        offloading_spec(),
    )
    assert isinstance(tier, TierdSecondaryTier)
    return tier, view


@pytest.mark.parametrize("regions", [True, False])
async def test_shutdown_leaves_no_view_of_vllms_rows(tmp_path, spawn, regions: bool) -> None:
    daemon = await spawn(daemon_config(tmp_path, block_bytes=ROW))
    mapping = mmap.mmap(-1, CHUNKS * ROW)
    tier, view = tier_over(mapping, daemon.socket_path, regions=regions)
    try:
        rows = np.frombuffer(mapping, dtype=np.int8).reshape(CHUNKS, ROW)
        fill(rows, range(2), seed=4)
        expected = rows[:2].copy()
        del rows  # the test's own array: vLLM keeps none but the memoryview
        ks = keys("sd", 2)
        assert run_job(tier, 1, ks, [0, 1], load=False).success  # staged copies
        assert run_job(tier, 2, ks, [4, 5], load=True).success  # the direct channel
        assert bytes(mapping[4 * ROW : 6 * ROW]) == expected.tobytes()
    finally:
        tier.shutdown()
    # vLLM's TieringOffloadingManager.shutdown, then SharedOffloadRegion.cleanup, with
    # the tier object still alive: each raises BufferError while a view is exported.
    view.release()
    mapping.close()
    assert mapping.closed
    tier.shutdown()  # a second call (vLLM may make one) is harmless
