#!/usr/bin/env python
"""Remote level benchmark: the tier's reads and writes against raw redis-py, the latency a
remote existence check adds to a lookup, and the shared trace split across two daemons.

(a) Blocks through the tier against raw redis-py, same server, same run. Batches of 32
blocks of 64 KiB and of 256 KiB: ``RedisLevel.put`` against a pipelined ``SET`` of the
bare payloads, ``RedisLevel.get`` (every value checked before it is handed on) against a
pipelined ``GET``. Both clients are redis-py's asyncio client with hiredis, under uvloop
(the daemon's event loop). Each repetition empties the database (not timed), then writes
a batch of new keys through each, then reads them back through each, the order of the two
alternating. Reported as GB/s and as the ratio tier / raw (target: at least 0.8x). Two
more figures of the tier's write path, for information: a write that first asks which keys
the server holds (what the level does while writes find their blocks there already), and a
write of a batch the server already holds (against raw redis-py sending the bytes again).

(b) What the remote existence check adds to a lookup of 32 keys: an in-process chain
(``TierChain.find``) and a daemon (``Client.lookup`` over its socket), each without a
remote level (32 local hits) and with one (32 local hits; 32 local misses the server holds;
32 local misses it does not hold). The cases interleave call by call.

(c) The shared Mooncake trace split across two daemons by conversation (see
:func:`conversations`), both halves replayed at once (``tierd replay`` in two processes,
every block verified), with the remote level off, shared by both daemons, and private to
each (the same server under two key prefixes: capacity without sharing).

Every timing is the median of ``--runs`` runs (the spread min-max in brackets). The
markdown goes to docs/bench/remote.md; ``--quick`` is a smoke run that writes nothing. The
redis-server and the daemons are started here, on 127.0.0.1 and Unix sockets, and stopped
by their PIDs. A benchmark, not a test.

This script owns the command line and the order of the parts; the rest sits beside it:
``bench/remote_transfer.py`` (a), ``bench/remote_lookups.py`` (b), ``bench/remote_trace.py``
(c), ``bench/remote_servers.py`` (redis-server and the daemons), ``bench/remote_stats.py``
(the figures) and ``bench/remote_report.py`` (the markdown).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from bench.fragment import default_out, write_fragment
from bench.remote_lookups import part_b
from bench.remote_report import render
from bench.remote_servers import RedisServer
from bench.remote_stats import KiB
from bench.remote_trace import TRACE, part_c, split_trace
from bench.remote_transfer import part_a

ROOT = Path(__file__).resolve().parent.parent
OUT = default_out("remote")


# -- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each timing (a, b)")
    parser.add_argument("--reps", type=int, default=20, help="timed batches per run (a)")
    parser.add_argument("--batch", type=int, default=32, help="blocks per batch (a)")
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[64 * KiB, 256 * KiB], help="block sizes (a)"
    )
    parser.add_argument("--calls", type=int, default=1000, help="lookups per case per run (b)")
    parser.add_argument("--replay-runs", type=int, default=3, help="runs of each mode (c)")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--limit", type=int, help="replay only the first N requests (c)")
    parser.add_argument("--min-shared", type=int, default=3, help="see conversations() (c)")
    parser.add_argument("--block-bytes", type=int, default=16 * KiB, help="block size (c)")
    parser.add_argument("--cpu-share", type=float, default=0.05, help="CPU tier / unique (c)")
    parser.add_argument("--clients", type=int, default=2, help="replay clients per daemon (c)")
    parser.add_argument("--maxmemory", default="6gb", help="redis-server maxmemory (c)")
    parser.add_argument("--parts", default="abc", help="which parts to run (default: abc)")
    parser.add_argument("--quick", action="store_true", help="a smoke run; writes nothing")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.reps, args.calls, args.replay_runs = 1, 3, 50, 1
        args.limit = args.limit or 600
    args.tmp = Path(tempfile.mkdtemp(prefix="tierd-bench-remote-", dir="/tmp"))
    load_start = os.getloadavg()[0]
    transfer = lookups = split = replays = None
    server = RedisServer(args.tmp / "redis", args.maxmemory)
    try:
        if "a" in args.parts:
            transfer = part_a(server, args)
        if "b" in args.parts:
            lookups = part_b(server, args, args.tmp)
        if "c" in args.parts:
            if not args.trace.is_file():
                print(f"no trace at {args.trace}: part (c) skipped", file=sys.stderr)
            else:
                split = split_trace(args.trace, args.min_shared, args.limit)
                replays = part_c(server, args, split)
        version = server.version
    finally:
        server.stop()
        shutil.rmtree(args.tmp, ignore_errors=True)
    text = render(
        args,
        version,
        (load_start, os.getloadavg()[0]),
        transfer,
        lookups,
        split,
        replays,
        args.maxmemory,
    )
    write_fragment(text, None if args.quick else args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
