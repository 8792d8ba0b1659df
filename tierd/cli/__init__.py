"""The ``tierd`` command line.

Each family of subcommands lives in its own module and exports ``COMMANDS``: name ->
:class:`~tierd.cli.base.Command` (help line, argument setup, handler returning the exit
status). Exit codes are listed in :mod:`tierd.cli.base`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

import structlog

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

__all__ = ["FAMILY_OF", "Command", "build_parser", "commands", "main"]

# Each subcommand's family module, in the order ``tierd --help`` lists them. Only the
# module of the command being run is imported: ``tierd stats`` from a monitoring script
# must not pay for the trace replayer, the plots and the config models. Each module's
# ``COMMANDS`` must name exactly its commands here (tests/test_cli_output.py checks it).
FAMILY_OF = {
    "serve": "serve_cmd",
    "stop": "serve_cmd",
    "stats": "control_cmd",
    "events": "control_cmd",
    "flush": "control_cmd",
    "clear": "control_cmd",
    "health": "control_cmd",
    "sizes": "control_cmd",
    "namespaces": "namespace_cmd",
    "inspect": "namespace_cmd",
    "delete": "namespace_cmd",
    "reload": "namespace_cmd",
    "simulate": "offline",
    "trace": "offline",
    "config": "config_cmd",
    "top": "top_cmd",
    "replay": "replay_cmd",
    "record": "record_cmd",
    "engine-config": "engine_config_cmd",
}


def commands(only: str | None = None) -> dict[str, Command]:
    """Every subcommand, or only the family of the subcommand ``only`` (imported alone)."""
    families = [FAMILY_OF[only]] if only in FAMILY_OF else dict.fromkeys(FAMILY_OF.values())
    found: dict[str, Command] = {}
    for family in families:
        found.update(importlib.import_module(f"tierd.cli.{family}").COMMANDS)
    return found


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierd", description="A tiered KV-cache block store for LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"tierd {__version__}")
    sub_parsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in commands(only).items():
        sub = sub_parsers.add_parser(name, help=command.help, description=command.help)
        command.configure(sub)
        sub.set_defaults(run=command.run, usage_of=sub)
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
    args, unknown = build_parser(_command_named(argv)).parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's, names what it takes
        args.usage_of.error(f"unrecognized arguments: {' '.join(unknown)}")
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


def _command_named(argv: Sequence[str] | None) -> str | None:
    """The subcommand the arguments name (their first that is not an option), if any."""
    words = sys.argv[1:] if argv is None else argv
    first = next((word for word in words if not word.startswith("-")), None)
    return first if first in FAMILY_OF else None


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
