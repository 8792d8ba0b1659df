#!/usr/bin/env python3
"""The soak and chaos campaign against the daemon (``scripts/soak``).

::

    scripts/soak [--minutes 10] [--clients 16] [--out /tmp/tierd-soak] [--seed 1]

Runs a real daemon in a child process with small tiers (64 KiB blocks, 64 CPU blocks,
512 disk blocks) and drives it for ``--minutes`` with ``--clients`` verifying clients, a
protocol fuzzer and a subscriber that never reads, while it SIGKILLs and restarts the
daemon, SIGKILLs clients holding leases and injects disk write errors, ENOSPC, a full
disk, read errors and a slow disk (``tests/soak_kit.py`` has the whole story). Prints a
table and writes ``OUT/soak.json``; the daemon's logs are under ``OUT/work``. A progress
bar of the load's minutes goes to stderr when it is a terminal (``--progress`` /
``--no-progress``). Exit status 0 when every check passed, 1 otherwise (the reasons are
listed), 2 on bad arguments.

Expect figures to vary with whatever else runs on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for path in (str(ROOT), str(ROOT / "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

import soak_kit  # noqa: E402

from tierd.cli.progress import add_progress_option, make_bar  # noqa: E402

BAR_TICK_S = 1.0  # how often the bar moves


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/soak", description=__doc__.split("::")[0].strip()
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the load")
    parser.add_argument("--clients", type=int, default=16, help="verifying client connections")
    parser.add_argument(
        "--out", type=Path, default=Path("/tmp/tierd-soak"), help="report directory"
    )
    parser.add_argument("--seed", type=int, default=1, help="seeds the load and the faults")
    parser.add_argument(
        "--keep-disk", action="store_true", help="keep the disk tier's slab under OUT/work"
    )
    add_progress_option(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.minutes <= 0 or args.clients < 1:
        print("scripts/soak: --minutes must be > 0 and --clients >= 1", file=sys.stderr)
        return 2
    settings = soak_kit.Settings(seconds=args.minutes * 60, clients=args.clients, seed=args.seed)
    out: Path = args.out
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sock_dir = tempfile.mkdtemp(prefix="tierd-soak-", dir="/tmp")  # socket paths are short
    try:
        campaign = soak_kit.run_campaign(settings, work, f"{sock_dir}/tierd.sock")
        report = _run(_with_bar(campaign, settings.seconds, args.progress))
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
        if not args.keep_disk:
            shutil.rmtree(work / "disk", ignore_errors=True)
    (out / "soak.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(soak_kit.render(report))
    print(f"\nreport: {out / 'soak.json'}")
    return 0 if report["passed"] else 1


async def _with_bar(
    campaign: Coroutine[Any, Any, dict[str, Any]], seconds: float, flag: bool | None
) -> dict[str, Any]:
    """Run ``campaign``, moving a bar of its ``seconds`` of load once a second; the final
    checks come on top (the bar then stays full and says so)."""
    total = max(1, round(seconds))
    bar = make_bar(flag, total, label="soak", unit="s")
    if bar is None:
        return await campaign
    task = asyncio.ensure_future(campaign)
    started = time.monotonic()
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=BAR_TICK_S)
            elapsed = round(time.monotonic() - started)
            bar(min(total, elapsed), total, "final checks" if elapsed >= total else "load")
        return task.result()
    finally:
        task.cancel()  # a no-op once it is done
        bar.close()


def _run(coro):  # type: ignore[no-untyped-def]
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":
    raise SystemExit(main())
