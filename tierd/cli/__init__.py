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
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeAlias, cast

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

if TYPE_CHECKING:
    from importlib.abc import Loader  # not at run time: it imports importlib.resources

    _SubParsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

__all__ = [
    "FAMILY_OF",
    "SUMMARY_OF",
    "Command",
    "build_parser",
    "commands",
    "index_parser",
    "main",
]

# Each subcommand's family module, in the order ``tierd --help`` lists them. Only the
# module of the command being run is imported: ``tierd stats`` from a monitoring script
# must not pay for the trace replayer, the plots and the config models. Each module's
# ``COMMANDS`` must name exactly its commands here (tests/test_light_install.py checks it).
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

# Each subcommand's help line, as its ``Command`` says it (the same test checks that): what
# ``tierd --help`` lists, and an unknown command's error, without importing any family.
SUMMARY_OF = {
    "serve": "run the daemon in the foreground",
    "stop": "stop the daemon (drain, write back, exit) and wait until it is gone",
    "stats": "print the daemon's figures per tier, route and server",
    "events": "print the blocks stored and removed in every tier as they happen",
    "flush": "copy every dirty block down to the next tier (and to the remote level)",
    "clear": "remove the blocks of every tier, or of one",
    "health": "check that the daemon answers, is not stopping and its remote levels work",
    "sizes": "list each tenant's block sizes, or give one back",
    "namespaces": "list the namespaces: blocks per tier, bytes, hits, stores",
    "inspect": "say where one key lives",
    "delete": "delete keys, a key prefix or a whole namespace from every tier",
    "reload": "make the daemon read its config again and apply what can change live",
    "simulate": "replay a trace through a tier; print its hit ratio",
    "trace": "work with trace files (generate)",
    "config": "validate or print the daemon's configuration (check, show)",
    "top": "a live view of a running daemon (q or Ctrl-C quits)",
    "replay": "drive a daemon (or in-process chains) with a trace, verifying every byte",
    "record": "record live traffic as a trace (on, off, status)",
    "engine-config": "print the flags that put this daemon under vLLM or SGLang",
}


def commands(only: str | None = None) -> dict[str, Command]:
    """Every subcommand, or only the family of the subcommand ``only`` (imported alone)."""
    families = [FAMILY_OF[only]] if only in FAMILY_OF else dict.fromkeys(FAMILY_OF.values())
    found: dict[str, Command] = {}
    for family in families:
        found.update(importlib.import_module(f"tierd.cli.{family}").COMMANDS)
    return found


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or only the family of the subcommand ``only``."""
    parser, sub_parsers = _top_parser()
    for name, command in commands(only).items():
        sub = sub_parsers.add_parser(name, help=command.help, description=command.help)
        command.configure(sub)
        sub.set_defaults(run=command.run, usage_of=sub)
    return parser


def index_parser() -> argparse.ArgumentParser:
    """The command line when the arguments name no subcommand (``tierd --help``, ``tierd
    bogus``): every subcommand listed with its help line, none of their modules imported.
    It answers only with help, a version or a usage error."""
    parser, sub_parsers = _top_parser()
    for name, summary in SUMMARY_OF.items():
        sub_parsers.add_parser(name, help=summary, description=summary)
    return parser


def _top_parser() -> tuple[argparse.ArgumentParser, _SubParsers]:
    parser = argparse.ArgumentParser(
        prog="tierd", description="A tiered KV-cache block store for LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"tierd {__version__}")
    sub_parsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    return parser, sub_parsers


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
    named = _command_named(argv)
    parser = build_parser(named) if named is not None else index_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's, names what it takes
        args.usage_of.error(f"unrecognized arguments: {' '.join(unknown)}")
    waiting = _configure_logging()
    try:
        status: int = args.run(args)
    except (UsageError, UnknownPolicy) as exc:
        return _fail(str(exc), EXIT_USAGE)
    except ConfigError as exc:
        return _fail(f"invalid configuration:\n{exc}", EXIT_CONFIG)
    except TierdError as exc:  # a malformed trace (TraceError), say
        return _fail(str(exc), EXIT_BAD_INPUT)
    finally:
        if waiting is not None and waiting in sys.meta_path:  # structlog never came
            sys.meta_path.remove(waiting)
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


def _configure_logging() -> _ConfigureOnImport | None:
    """Logs go to stderr, so stdout carries only the command's output. ``serve``
    reconfigures logging from its config.

    structlog is configured now if the command's module loaded it, else the moment
    anything imports it (the finder returned, which ``_main`` removes if that never
    happens): a command that only talks to the daemon never loads structlog, whose
    import (rich's, where installed) would take longer than the rest of the command."""
    if "structlog" in sys.modules:
        _configure_structlog(sys.modules["structlog"])
        return None
    waiting = _ConfigureOnImport()
    sys.meta_path.insert(0, waiting)
    return waiting


def _configure_structlog(structlog: Any) -> None:
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(_CurrentStderr()),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )


class _ConfigureOnImport:
    """A ``sys.meta_path`` finder: finds structlog as the other finders do, and has it
    configured once its package has run, before the importer gets it. Leaves
    ``sys.meta_path`` on its first call."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != "structlog":
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)  # a legacy finder may lack it
            spec: ModuleSpec | None = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = cast("Loader", _ThenConfigure(spec.loader))
                return spec
        return None


class _ThenConfigure:
    """structlog's own loader, then :func:`_configure_structlog`; the module keeps the
    real loader."""

    def __init__(self, loader: Loader) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _configure_structlog(module)


def _fail(message: str, status: int) -> int:
    print(f"tierd: error: {message}", file=sys.stderr)
    return status
