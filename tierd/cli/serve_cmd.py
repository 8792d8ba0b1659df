"""``tierd serve``: run the daemon in the foreground until SIGTERM or SIGINT.

The config comes from the same layers as ``tierd config show`` (defaults < file <
``TIERD_*`` environment < ``--set``); an invalid one raises
:class:`~tierd.errors.ConfigError` before anything starts (exit status 78). Logging is
reconfigured from the config's ``logging`` section by :func:`tierd.daemon.run_daemon`,
replacing the command line's warnings-only default. The exit status is the daemon's: 0
after a clean stop, 1 after a forced one (a second signal) or when another daemon
already serves the socket.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tierd.cli.base import EXIT_BAD_INPUT, Command, add_sets
from tierd.errors import AlreadyRunning
from tierd.settings import load_settings

__all__ = ["COMMANDS"]

EXIT_INTERRUPTED = 130  # Ctrl-C before the daemon installed its own signal handlers


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-c", "--config", type=Path, help="the YAML config file (default: $TIERD_CONFIG, if set)"
    )
    add_sets(parser)


def _run(args: argparse.Namespace) -> int:
    cfg = load_settings(args.config, sets=args.sets)
    # The daemon's module pulls in the stores (and torch): load it only to serve.
    from tierd.daemon import run_daemon

    try:
        return run_daemon(cfg)
    except AlreadyRunning as exc:
        return _fail(str(exc), EXIT_BAD_INPUT)
    except OSError as exc:  # the socket's directory is missing or not writable, say
        return _fail(f"cannot start the daemon: {exc}", EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _fail(message: str, status: int) -> int:
    print(f"tierd: error: {message}", file=sys.stderr)
    return status


COMMANDS: dict[str, Command] = {
    "serve": Command("run the daemon in the foreground", _configure, _run),
}
