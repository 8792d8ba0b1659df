"""What every ``tierd`` subcommand shares: the command record, exit codes, usage errors.

Exit status, for scripts to rely on:

- 0 success;
- 1 the operation failed or its input is unusable (a malformed trace, an error reply);
- 2 a usage error (bad arguments, an unknown policy, a trace file that does not exist);
- 3 the daemon cannot be reached (no socket, connection refused, not allowed);
- 78 the configuration is invalid or missing (``EX_CONFIG``; systemd can refuse to
  restart on it): a config file that does not exist is 78 for every command, as for
  ``tierd serve``, which restarting cannot fix.

``tests/test_exit_statuses.py`` keeps each status documented in the README true.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tierd.errors import ConfigError
from tierd.units import parse_size

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_CONFIG",
    "EXIT_OK",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "Command",
    "UsageError",
    "add_sets",
    "require_config_file",
]

EXIT_OK, EXIT_BAD_INPUT, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_CONFIG = 0, 1, 2, 3, 78


class UsageError(Exception):
    """A command-line mistake: reported on stderr, exit status 2."""


def require_config_file(path: Path) -> None:
    """A config file named on the command line must exist: :class:`ConfigError` (exit
    status 78) otherwise, before a trace is read or a daemon is asked."""
    if not path.is_file():
        reason = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {path} {reason}")


def add_sets(parser: argparse.ArgumentParser) -> None:
    """The repeatable ``--set PATH=VALUE`` override (highest precedence), as ``args.sets``."""
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override one value, e.g. socket.mode=0o660 or tiers.0.capacity=2GiB (repeatable)",
    )


@dataclass(frozen=True, slots=True)
class Command:
    """One subcommand: its help line, how it adds its arguments, and what it runs."""

    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def size_argument(text: str) -> int:
    """A command-line size (bytes, or with a unit: ``64KiB``): argparse's error names why."""
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def count_argument(text: str) -> int:
    """A command-line count of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
