"""Engine host regions between tenants, from real processes of other users.

A region belongs to the connection that registered it: another tenant's client naming its
id gets ``unknown_region`` (it has no such region), and with a region of its own it loads
nothing of the first tenant's blocks, even under the same namespace and keys. Uses the
daemon, users and client children of ``tests/tenants_kit.py`` (root only).
"""

from __future__ import annotations

from tests.daemon_kit import DaemonProcess
from tests.tenants_kit import NEEDS_ROOT, as_user, connect

pytestmark = NEEDS_ROOT


async def test_a_tenant_cannot_reach_another_tenants_region_or_blocks(
    daemon: DaemonProcess, users: dict[str, tuple[int, int]]
) -> None:
    names = ["page-0", "page-1"]
    _, region, stored, loaded = await as_user(
        daemon,
        users["alpha"],
        connect(),
        {"do": "region", "blocks": 4, "fill": 0xA1},
        {"do": "region_store", "region": 1, "keys": names, "rows": [0, 1]},
        {"do": "region_load", "region": 1, "keys": names, "rows": [2, 3]},
    )
    assert (region, stored, loaded) == (1, [True, True], ["a1", "a1"])
    # Beta names alpha's region id before it has one, then with its own region of the
    # same id asks for alpha's keys under the same namespace.
    _, foreign, own, theirs, mine = await as_user(
        daemon,
        users["beta"],
        connect(),
        {"do": "region_load", "region": 1, "keys": names, "rows": [0, 1]},
        {"do": "region", "blocks": 4, "fill": 0xB2},
        {"do": "region_load", "region": 1, "keys": names, "rows": [0, 1]},
        {"do": "region_store", "region": 1, "keys": names, "rows": [2, 3]},
    )
    assert foreign["error"] == "unknown_region"
    assert (own, theirs, mine) == (1, [False, False], [True, True])
    # Alpha's blocks are still alpha's.
    _, _, again = await as_user(
        daemon,
        users["alpha"],
        connect(),
        {"do": "region", "blocks": 4, "fill": 0x00},
        {"do": "region_load", "region": 1, "keys": names, "rows": [0, 1]},
    )
    assert again == ["a1", "a1"]
