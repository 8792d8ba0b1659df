"""``tierd config check|show``: validate the daemon's configuration, or print the effective
one, without starting anything. Both read the same layers as ``tierd serve`` (defaults <
file < ``TIERD_*`` environment < ``--set``; see :mod:`tierd.settings`); an invalid config
raises :class:`~tierd.errors.ConfigError`, which the ``tierd`` wrapper reports with exit
status 78. ``check`` also checks the tiers against this machine (free disk space,
available memory, a CUDA device for a GPU tier; see :mod:`tierd.preflight`), as ``tierd
serve`` does, and warns of each remote level whose server takes no connection from here
within a second (:mod:`tierd.cli.remote_probe`: a warning on stderr, exit status still 0,
for the daemon starts without it); ``check --offline`` (or ``--no-machine-checks``) skips
those, for a config meant for another machine: the schema and the cross-field rules only.

``show`` without ``-c`` or ``--set`` prints what the running daemon runs, asked over its
socket (``--socket``, else ``$TIERD_SOCKET``, else ``$TIERD_CONFIG``'s, else
``$TIERD_SOCKET__PATH``, else the default path); when no daemon answers there (and
``--socket`` did not name it), what ``tierd serve`` would run: ``$TIERD_CONFIG``, else the
shipped default config. ``-c FILE`` (or ``--set``) prints that file's config, asking no
daemon. A note on stderr says which.

The config models, the machine checks and YAML load only where used: ``show`` asking a
running daemon for ``--json`` needs none of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierd.cli.base import EXIT_OK, Command, add_sets
from tierd.cli.connection import (
    SOCKET_ENV,
    CannotReach,
    socket_path,
    talks_to_daemon,
    with_client,
)
from tierd.cli.serve_cmd import serve_config_file
from tierd.control.socketfile import CONFIG_ENV, SOCKET_PATH_ENV

if TYPE_CHECKING:
    from tierd.config import DaemonConfig

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
        "(disk space, memory, CUDA, whether the remote levels' servers take a connection):"
        " for a config meant for another machine",
    )
    add_sets(check)
    show = actions.add_parser(
        "show",
        help="print the running daemon's configuration (with no daemon: what `tierd serve`"
        " would run)",
    )
    show.add_argument(
        "-c",
        "--config",
        type=Path,
        help="print this file's config (with TIERD_* variables and --set), asking no daemon",
    )
    add_sets(show)
    show.add_argument(
        "--socket",
        type=Path,
        metavar="PATH",
        help=f"the daemon to ask (default: ${SOCKET_ENV}, else ${CONFIG_ENV}'s,"
        f" else ${SOCKET_PATH_ENV}, else the default path)",
    )
    show.add_argument(
        "--trust-uid",
        type=int,
        action="append",
        metavar="UID",
        help="ask a daemon run by this uid too (default: only this user's or root's)",
    )
    show.add_argument("--json", action="store_true", help="print JSON instead of YAML")


def _run(args: argparse.Namespace) -> int:
    if args.action == "check":
        from tierd.settings import load_settings

        cfg = load_settings(args.file, sets=args.sets)
        if args.offline:
            print(f"ok: {args.file} ({describe(cfg)}); machine checks skipped (--offline)")
            return EXIT_OK
        from tierd.preflight import check_machine  # the stores' probes: numpy

        check_machine(cfg)
        _warn_unreachable(cfg)
        print(f"ok: {args.file} ({describe(cfg)})")
        return EXIT_OK
    return _show(args)


def _warn_unreachable(cfg: DaemonConfig) -> None:
    """A warning per remote level's server that takes no connection from here: the config
    is valid all the same (the daemon starts, and the level misses until it answers)."""
    if cfg.remote is None:
        return
    from tierd.cli.remote_probe import unreachable

    for line in unreachable(cfg.remote.levels()):
        print(
            f"tierd: warning: {line} (the config is valid: the daemon would start, and this"
            " level would miss until its server answers)",
            file=sys.stderr,
        )


@talks_to_daemon
def _show(args: argparse.Namespace) -> int:
    data = _shown(args)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        import yaml

        print(yaml.safe_dump(data, sort_keys=False), end="")
    return EXIT_OK


def _shown(args: argparse.Namespace) -> dict[str, Any]:
    """The config ``show`` prints (which one: see the module's docstring)."""
    if args.config is not None or args.sets:
        return _effective(args.config, args.sets)
    path = socket_path(args)
    try:
        data = with_client(args, lambda client: client.config())
    except CannotReach as exc:
        if args.socket is not None:
            raise
        file = serve_config_file(None) or os.environ.get(CONFIG_ENV)
        _note(f"no daemon answers at {path}: {exc.reason}")
        _note(f"showing what `tierd serve` would run ({file})")
        return _effective(file, [])
    _note(f"the running daemon's config (at {path})")
    return data


def _effective(file: Path | str | None, sets: list[str]) -> dict[str, Any]:
    """The config from ``file`` and the other layers, as ``show`` prints it."""
    from tierd.settings import effective_config_dict, load_settings

    return effective_config_dict(load_settings(file, sets=sets))


def _note(text: str) -> None:
    print(f"tierd config show: {text}", file=sys.stderr)


def describe(cfg: DaemonConfig) -> str:
    """One line: ``2 tiers: cpu 4096 blocks lru, disk ...; block 256KiB; socket PATH``."""
    from tierd.config import S3Config

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
