"""The ``tierd`` command line.

Each family of subcommands lives in its own module and exports ``COMMANDS``: name ->
:class:`~tierd.cli.base.Command` (help line, argument setup, handler returning the exit
status). Exit codes are listed in :mod:`tierd.cli.base`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import structlog

from tierd.cli import config_cmd, control_cmd, offline, record_cmd, replay_cmd, serve_cmd, top_cmd
from tierd.cli.base import (
    EXIT_BAD_INPUT,
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_USAGE,
    Command,
    UsageError,
)
from tierd.errors import ConfigError, TierdError, UnknownPolicy
from tierd.version import __version__

__all__ = ["COMMANDS", "Command", "build_parser", "main"]

COMMANDS: dict[str, Command] = {
    **serve_cmd.COMMANDS,
    **control_cmd.COMMANDS,
    **offline.COMMANDS,
    **config_cmd.COMMANDS,
    **top_cmd.COMMANDS,
    **replay_cmd.COMMANDS,
    **record_cmd.COMMANDS,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierd", description="A tiered KV-cache block store for LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"tierd {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.help, description=command.help)
        command.configure(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tierd`` command; returns the exit status.

    A reader that goes away (``tierd top --plain | head``) ends the command quietly with
    status 0: what it did not read was not wanted."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # here, not at exit, so that a closed pipe shows up here
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_OK
    return status


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush does not fail again (the
    recipe of the Python documentation, under "Note on SIGPIPE")."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a file (a test's capture, say)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging()
    try:
        status: int = args.run(args)
    except (UsageError, UnknownPolicy) as exc:
        return _fail(str(exc), EXIT_USAGE)
    except ConfigError as exc:
        return _fail(f"invalid configuration:\n{exc}", EXIT_CONFIG)
    except TierdError as exc:  # a malformed trace (TraceError), say
        return _fail(str(exc), EXIT_BAD_INPUT)
    return status


class _CurrentStderr:
    """Whatever ``sys.stderr`` is at write time (a test's capture may replace it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _configure_logging() -> None:
    """Logs go to stderr, so stdout carries only the command's output. ``serve``
    reconfigures logging from its config."""
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(_CurrentStderr()),  # type: ignore[arg-type]
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )


def _fail(message: str, status: int) -> int:
    print(f"tierd: error: {message}", file=sys.stderr)
    return status
