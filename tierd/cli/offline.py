"""Offline commands that need no daemon: ``tierd simulate`` and ``tierd trace``.

``simulate`` draws a progress bar on stderr when it is a terminal (``--progress`` /
``--no-progress``); Ctrl-C ends it early with the results so far, marked ``interrupted
after N of M requests``, and exit status 130. A trace that is missing is a usage error
(2); one that cannot be used (a directory, unreadable, not UTF-8, a malformed line) is
unusable input (1), with a one-line message naming the file and line. ``simulate --config``
is a what-if: it starts cold in a private directory unless ``--warm DIR``
(:mod:`tierd.cli.whatif`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tierd.cli.base import EXIT_OK, Command, UsageError, count_argument, require_config_file
from tierd.cli.curve_cmd import check_curve_args, run_curve
from tierd.cli.disk_notice import announce, chain_disks
from tierd.cli.progress import (
    EXIT_INTERRUPTED,
    add_progress_option,
    interrupted_line,
    make_bar,
    stop_flag,
)
from tierd.cli.whatif import add_warm_option, what_if_config
from tierd.config import ChainConfig, load_config
from tierd.policy import policy_class, policy_names
from tierd.workload import SimulationResult, read_trace, simulate, write_trace
from tierd.workload.generate import GeneratorConfig, generate
from tierd.workload.trace import Trace

if TYPE_CHECKING:
    from tierd.workload.replay_figures import ReplaySummary

__all__ = ["COMMANDS", "load_trace"]


# -- tierd simulate ------------------------------------------------------------------------


def _configure_simulate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", type=Path, help="a Mooncake-format JSONL trace")
    parser.add_argument(
        "--policy", default="lru", help=f"cache policy ({', '.join(policy_names())}; default lru)"
    )
    parser.add_argument(
        "--capacity",
        default="10%",
        help="tier size in blocks, or a share of the trace's unique blocks like 5%% (default 10%%)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="replay through the whole chain of this YAML config instead (hits per medium); "
        "with --curve, mark its tiers on the curve",
    )
    parser.add_argument(
        "--curve",
        action="store_true",
        help="the LRU hit ratio at every capacity in one pass (--capacity is not used)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="PATH",
        help="with --curve: draw it into this PNG file, or into DIR/curve.png for a directory",
    )
    parser.add_argument(
        "--limit", type=count_argument, metavar="N", help="only the trace's first N requests"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_warm_option(parser)
    add_progress_option(parser)


def load_trace(path: Path) -> Trace:
    """The trace a command was given: a missing file is a usage error; any other trouble
    is a :class:`~tierd.errors.TraceError` naming the file (and line)."""
    if not path.exists():
        raise UsageError(f"trace file not found: {path}")
    return read_trace(path)


def _run_simulate(args: argparse.Namespace) -> int:
    policy_class(args.policy)  # an unknown name fails before the trace is read
    check_curve_args(args)
    if args.warm is not None and (args.config is None or args.curve):
        raise UsageError("--warm applies to --config (a chain's what-if) only")
    trace = load_trace(args.trace)
    if args.limit is not None:
        trace = trace.first(args.limit)
    if args.curve:
        return run_curve(args, trace)
    if args.config is not None:
        return _run_chain_simulate(args, trace)
    bar = make_bar(args.progress, len(trace))
    try:
        with stop_flag() as stop:
            result = simulate(trace, args.policy, args.capacity, progress=bar, stop=stop)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print(json.dumps({"trace": str(args.trace), **result.to_dict()}))
    else:
        print(_describe(result))
    return EXIT_INTERRUPTED if result.interrupted else EXIT_OK


def _run_chain_simulate(args: argparse.Namespace, trace: Trace) -> int:
    """The chain of ``--config``, driven by the replay engine in its hit-ratio mode."""
    from tierd.library import open_chain  # torch and the stores load only when needed
    from tierd.workload.backends import replay_chain

    require_config_file(args.config)
    cfg = load_config(args.config, ChainConfig)
    announce(trace, None, cfg.block_bytes, chain_disks(cfg, args.config.stem, args.warm))

    async def run() -> ReplaySummary:
        with what_if_config(cfg, args.config.stem, args.warm) as private:
            async with open_chain(private) as chain:
                return await replay_chain(chain, trace, progress=bar, stop=stop)

    bar = make_bar(args.progress, len(trace))
    try:
        with stop_flag() as stop:
            result = asyncio.run(run())
    finally:
        if bar is not None:
            bar.close()
    status = EXIT_INTERRUPTED if result.interrupted else EXIT_OK
    if args.json:
        print(
            json.dumps({"trace": str(args.trace), "config": str(args.config), **result.to_dict()})
        )
        return status
    print("\n".join(_chain_lines(result)))
    return status


def _chain_lines(result: ReplaySummary) -> list[str]:
    from tierd.cli.replay_report import repeats_line, start_line

    lines = []
    if result.interrupted:
        lines.append(interrupted_line(result.requests, result.planned_requests))
    lines += [start_line(result), repeats_line(result)]
    lines += [f"hit ratio       {result.hit_ratio:.4f} ({result.hits:,} block hits)"]
    for medium, ratio in result.hit_ratio_by_medium.items():
        lines.append(f"  from {medium:<9} {ratio:.4f} ({result.hits_by_medium[medium]:,})")
    for tier in result.tiers:
        lines.append(
            f"tier {tier['name']:<10} {tier['medium']:<5} {tier['capacity']:,} blocks, "
            f"{tier['policy']}, {tier['evictions']:,} evictions"
        )
    rate = result.throughput["accesses_per_s"]
    lines += [
        f"requests        {result.requests:,}",
        f"block accesses  {result.block_accesses:,}",
        f"accesses/s      {rate:,.0f} ({result.seconds:.3f} s)",
    ]
    return lines


def _describe(result: SimulationResult) -> str:
    mark = [interrupted_line(result.requests, result.planned_requests)]
    return "\n".join(
        [
            *(mark if result.interrupted else []),
            f"policy          {result.policy}",
            f"capacity        {result.capacity:,} blocks "
            f"({result.capacity / result.unique_blocks:.1%} of {result.unique_blocks:,} "
            "unique blocks)",
            f"hit ratio       {result.hit_ratio:.4f} ({result.hits:,} block hits)",
            f"requests        {result.requests:,}",
            f"block accesses  {result.block_accesses:,}",
            f"accesses/s      {result.accesses_per_second:,.0f} ({result.seconds:.3f} s)",
        ]
    )


# -- tierd trace generate ------------------------------------------------------------------


def _configure_trace(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    gen = actions.add_parser("generate", help="write a seeded synthetic trace")
    defaults = GeneratorConfig()
    gen.add_argument("--out", required=True, help="output file ('-' for stdout)")
    gen.add_argument("--seed", type=int, default=defaults.seed)
    gen.add_argument("--conversations", type=int, default=defaults.conversations)
    gen.add_argument("--system-prompts", type=int, default=defaults.system_prompts)
    gen.add_argument("--documents", type=int, default=defaults.documents)
    gen.add_argument("--document-share", type=float, default=defaults.document_share)
    gen.add_argument("--zipf", type=float, default=defaults.zipf_exponent)
    gen.add_argument("--mean-turns", type=float, default=defaults.mean_turns)


def _run_trace(args: argparse.Namespace) -> int:
    try:
        config = GeneratorConfig(
            seed=args.seed,
            conversations=args.conversations,
            system_prompts=args.system_prompts,
            documents=args.documents,
            document_share=args.document_share,
            zipf_exponent=args.zipf,
            mean_turns=args.mean_turns,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    records = generate(config)
    try:
        count = write_trace(sys.stdout if args.out == "-" else Path(args.out), records)
    except BrokenPipeError:
        raise  # the reader went away: ``tierd.cli.main`` ends quietly
    except OSError as exc:
        raise UsageError(f"cannot write {args.out}: {exc.strerror}") from None
    accesses = sum(len(record.hash_ids) for record in records)
    unique = len({block for record in records for block in record.hash_ids})
    print(
        f"wrote {count:,} requests ({accesses:,} block accesses, {unique:,} unique blocks) "
        f"to {args.out}",
        file=sys.stderr if args.out == "-" else sys.stdout,
    )
    return EXIT_OK


COMMANDS: dict[str, Command] = {
    "simulate": Command(
        "replay a trace through a tier; print its hit ratio", _configure_simulate, _run_simulate
    ),
    "trace": Command("work with trace files (generate)", _configure_trace, _run_trace),
}
