"""The soak and chaos campaign against a real tierd daemon.

Used by ``scripts/soak`` (the 10-minute run) and ``tests/test_soak.py`` (the CI run).

A :class:`Campaign` runs the daemon of :func:`soak_config` in a child process
(``tests/soak_daemon.py serve``: a real daemon on a loopback Unix socket, its disk tier on
a fault-injecting file layer) and drives it for a while with:

- ``clients`` :class:`Worker` tasks, each on its own connection: lookup the leading blocks
  of a random request (prefix chains of ``seq_len`` keys, Zipf popularity, a key space
  several times the tiers), load the hits through the shared pool and verify every byte,
  store the rest through the pool (:meth:`tierd.client.Client.store`), touch now and then;
- a :class:`Fuzzer` on a connection of its own (random bytes, random msgpack maps with the
  protocol's op names, valid frames flipped, truncated or padded), reading every reply;
- a :class:`StuckSubscriber` that subscribes to events and never reads its socket;
- two fault lanes at seeded random times: the *process lane* SIGKILLs the daemon (a
  *checkpoint* kill after a durability snapshot, or a *hot* kill under full load) and
  restarts it, and SIGKILLs clients holding a store or a load lease; the *disk lane* runs
  episodes of injected write EIO, write ENOSPC, a full disk (torn block writes and journal
  ENOSPC), read EIO and a slow disk.

Durability check (each checkpoint kill, and the final clean restart): stop the load and
the fuzzer, wait until the daemon is idle (no pin, no block in flight, no lease, no stray
connection), ``flush``, ``clear`` the CPU tier, and look every key up: what is present now
is on the disk tier. SIGKILL, restart, and every one of those keys must be served back
byte-identical; a key that is not is *lost*. Blocks the disk tier evicted earlier for room
are never counted as lost, because the set is read from the daemon right before the kill.

At the end: the load stops, every key the daemon still holds is loaded and verified, pins,
in-flight blocks and leases must be back to zero, the daemon's resident memory must stay
within the rule of :func:`judge`, and a SIGTERM must exit 0. :func:`judge` lists the
reasons a run fails; :func:`render` draws the table of a report.

This module is the kit's front: :func:`run_campaign`, and every name of the kit that
``scripts/soak.py`` and the tests use, from the modules that own them:

- ``soak_settings``: :class:`Settings`, :func:`soak_config`, the fault kinds, constants;
- ``soak_load``: the key space, the tallies, the gate, the :class:`Worker` clients;
- ``soak_fuzz``: the :class:`Fuzzer` and the :class:`StuckSubscriber`;
- ``soak_procs``: the daemon's process, lease-holding children, :func:`wait_idle`;
- ``soak_rig``: the daemon as the campaign holds it, the fault switch, the checks;
- ``soak_lanes``: the seeded :func:`schedule` and the two fault lanes;
- ``soak_campaign``: the :class:`Campaign` and its report;
- ``soak_report``: :func:`judge`, :func:`render` and the memory rule;
- ``soak_daemon`` (the daemon runner and its fault layer) and ``soak_hostile`` (the
  misbehaving clients, the real full file system), as before.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
for _path in (str(TESTS.parent), str(TESTS)):
    if _path not in sys.path:
        sys.path.insert(1, _path)

from soak_campaign import Campaign  # noqa: E402
from soak_fuzz import CODES, FIELDS, OPS, Fuzzer, StuckSubscriber  # noqa: E402
from soak_lanes import FaultLanes, schedule  # noqa: E402
from soak_load import Gate, KeySpace, Tally, Worker  # noqa: E402
from soak_procs import (  # noqa: E402
    DaemonFailed,
    DaemonProcess,
    child_env,
    idle_figures,
    spawn_holder,
    wait_idle,
)
from soak_report import RSS_FACTOR, RSS_SLACK_KIB, judge, render  # noqa: E402
from soak_rig import Checks, FaultSwitch, Rig  # noqa: E402
from soak_settings import (  # noqa: E402
    CLIENT_FAULTS,
    DEADLINE_S,
    DISK_EPISODES,
    EPISODE_COUNTERS,
    FAULT_KINDS,
    FUZZ_NAMESPACE,
    NAMESPACE,
    PROCESS_FAULTS,
    RUNNER,
    START_DEADLINE_S,
    STEADY_FAULTS,
    Settings,
    soak_config,
)

__all__ = [
    "CLIENT_FAULTS",
    "CODES",
    "DEADLINE_S",
    "DISK_EPISODES",
    "EPISODE_COUNTERS",
    "FAULT_KINDS",
    "FIELDS",
    "FUZZ_NAMESPACE",
    "NAMESPACE",
    "OPS",
    "PROCESS_FAULTS",
    "RSS_FACTOR",
    "RSS_SLACK_KIB",
    "RUNNER",
    "START_DEADLINE_S",
    "STEADY_FAULTS",
    "TESTS",
    "Campaign",
    "Checks",
    "DaemonFailed",
    "DaemonProcess",
    "FaultLanes",
    "FaultSwitch",
    "Fuzzer",
    "Gate",
    "KeySpace",
    "Rig",
    "Settings",
    "StuckSubscriber",
    "Tally",
    "Worker",
    "child_env",
    "idle_figures",
    "judge",
    "render",
    "run_campaign",
    "schedule",
    "soak_config",
    "spawn_holder",
    "wait_idle",
]


async def run_campaign(settings: Settings, workdir: Path, socket_path: str) -> dict[str, Any]:
    """Run one campaign; the report carries ``reasons`` and ``passed``."""
    report = await Campaign(settings, workdir, socket_path).run()
    report["reasons"] = judge(report)
    report["passed"] = not report["reasons"]
    return report
