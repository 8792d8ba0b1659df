"""``tierd record on|off|status``: turn the recording of live traffic on or off.

The daemon writes each sampled lookup as a Mooncake-format line per tenant (the config's
``trace:`` section; :mod:`tierd.control.figures.recorder`). Only an operator may send it. The
recorded files feed ``tierd simulate FILE --curve --config FILE`` (docs/sizing.md).
``status`` of a daemon whose config has no ``trace:`` section says what to add, and that
the daemon must restart to take it. Exit status: 0 success, 1 an error reply (not an
operator; ``on``/``off`` with no ``trace.directory``), 3 no daemon answers.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tierd.cli.base import EXIT_OK, Command
from tierd.cli.connection import add_socket_options, talks_to_daemon, with_client
from tierd.client import Client

__all__ = ["COMMANDS"]

_NOT_SET_UP = """recording    not set up: the daemon's config has no trace: section. Add one, e.g.
  trace:
    directory: /var/lib/tierd/traces   # one file per tenant, made private (0700)
    sample: 0.1                        # the share of requests recorded
then restart the daemon (tierd stop; tierd serve ...): a reload does not apply it.
docs/sizing.md has the other fields."""


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["on", "off", "status"])
    add_socket_options(parser)
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


@talks_to_daemon
def _run(args: argparse.Namespace) -> int:
    fields: dict[str, Any] = {} if args.action == "status" else {"enabled": args.action == "on"}

    async def ask(client: Client) -> dict[str, Any]:
        return dict((await client.request("trace", **fields))["trace"])

    state = with_client(args, ask)
    if args.json:
        print(json.dumps(state))
    elif not state.get("configured", True):
        print(_NOT_SET_UP)
    else:
        print(
            f"recording    {'on' if state['enabled'] else 'off'}\n"
            f"directory    {state['directory']}\n"
            f"sample       {state['sample']:g} of requests (whole, by their first key)\n"
            f"recorded     {state['recorded']:,} requests ({state['skipped']:,} not sampled)"
            + (f"\nerror        {state['error']}" if state["error"] else "")
        )
    return EXIT_OK


COMMANDS: dict[str, Command] = {
    "record": Command("record live traffic as a trace (on, off, status)", _configure, _run),
}
