"""The benchmarks of tierd, one module each, run by ``scripts/bench NAME [ARGS...]``.

Not shipped in the wheel (pyproject's packages.find takes ``tierd*`` only). Every module
here is an entry bench with ``main(argv) -> int`` and a one-line description (its
docstring's first line), except those named in :data:`HELPERS`: the parts other benches
import or start as children. ``scripts/bench list`` lists the entry benches.
"""

from __future__ import annotations

# The one place that says which modules are not entry benches.
HELPERS = frozenset(
    {
        "daemon_data",
        "daemon_report",
        "daemon_servers",
        "daemon_wire",
        "figures",
        "fragment",
        "pagecache",
        "remote_lookups",
        "remote_report",
        "remote_servers",
        "remote_stats",
        "remote_trace",
        "remote_transfer",
        "scale_growth",
        "scale_restart",
        "vllm_worker",
    }
)
