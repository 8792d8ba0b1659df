"""``tierd config check|show``: validate the daemon's configuration, or print the effective
one, without starting anything. Both read the same layers as ``tierd serve`` (defaults <
file < ``TIERD_*`` environment < ``--set``; see :mod:`tierd.settings`); an invalid config
raises :class:`~tierd.errors.ConfigError`, which the ``tierd`` wrapper reports with exit
status 78. ``check`` also checks the tiers against this machine (free disk space,
available memory, a CUDA device for a GPU tier; see :mod:`tierd.preflight`), as ``tierd
serve`` does; ``check --offline`` (or ``--no-machine-checks``) skips those, for a config
meant for another machine: the schema and the cross-field rules only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from tierd.cli.base import EXIT_OK, Command, add_sets
from tierd.config import DaemonConfig, S3Config
from tierd.preflight import check_machine
from tierd.settings import effective_config_dict, load_settings

__all__ = ["COMMANDS", "describe"]


def _configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check",
        help="validate a config file (with TIERD_* variables and --set) and summarise it",
    )
    check.add_argument("file", type=Path, help="the YAML config file")
    check.add_argument(
        "--offline",
        "--no-machine-checks",
        dest="offline",
        action="store_true",
        help="check the schema and cross-field rules only, not this machine "
        "(disk space, memory, CUDA): for a config meant for another machine",
    )
    add_sets(check)
    show = actions.add_parser("show", help="print the effective configuration")
    show.add_argument(
        "-c", "--config", type=Path, help="the YAML config file (default: $TIERD_CONFIG, if set)"
    )
    add_sets(show)
    show.add_argument("--json", action="store_true", help="print JSON instead of YAML")


def _run(args: argparse.Namespace) -> int:
    if args.action == "check":
        cfg = load_settings(args.file, sets=args.sets)
        if args.offline:
            print(f"ok: {args.file} ({describe(cfg)}); machine checks skipped (--offline)")
            return EXIT_OK
        check_machine(cfg)
        print(f"ok: {args.file} ({describe(cfg)})")
        return EXIT_OK
    data = effective_config_dict(load_settings(args.config, sets=args.sets))
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(yaml.safe_dump(data, sort_keys=False), end="")
    return EXIT_OK


def describe(cfg: DaemonConfig) -> str:
    """One line: ``2 tiers: cpu 4096 blocks lru, disk ...; block 256KiB; socket PATH``."""
    tiers = ", ".join(
        f"{tier.name} {tier.num_blocks(cfg.block_bytes)} blocks {tier.policy}" for tier in cfg.tiers
    )
    count = f"{len(cfg.tiers)} tier{'s' if len(cfg.tiers) != 1 else ''}"
    line = f"{count}: {tiers}; block {_format_size(cfg.block_bytes)}; socket {cfg.socket.path}"
    for level in cfg.remote.levels() if cfg.remote is not None else ():
        if isinstance(level, S3Config):
            where = f"s3 {level.endpoint or level.region}/{level.bucket}"
        else:
            where = level.url or "cluster " + ",".join(level.cluster_nodes or ())
        line += f"; remote {level.name} {where.rpartition('@')[2]}"
    if cfg.tenants:
        blocks = cfg.tenant_blocks()
        parts = [
            f"{t.name}{' (operator)' if t.operator else ''} "
            + "/".join(str(blocks[t.name][tier.name]) for tier in cfg.tiers)
            for t in cfg.tenants
        ]
        line += f"; tenants (blocks per tier): {', '.join(parts)}"
    return line


def _format_size(size: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return f"{size} bytes"


COMMANDS: dict[str, Command] = {
    "config": Command(
        "validate or print the daemon's configuration (check, show)", _configure, _run
    ),
}
