"""The cache by namespace, and reload: ``tierd namespaces``, ``inspect``, ``delete`` and
``reload``.

``namespaces`` lists each tenant's namespaces that hold blocks (blocks per tier, bytes,
hits, stores, last use; ``--all`` adds those that hold none, emptied or only looked up),
names escaped where a character would not print; ``inspect KEY`` says where one key
lives; ``delete`` removes keys, the keys under a prefix, or a whole namespace (``--all``:
a retired model), from every tier; ``reload`` makes the daemon read its config file
again and prints what it applied and what needs a restart. Keys are given as text
(UTF-8), or as hex with ``--hex``; ``inspect`` also takes a key as ``tierd events``
prints it: ``<namespace id>:<key in hex>`` (the namespace then need not be named), or
the key's hex alone, tried when the text is held nowhere.

A member acts on its own tenant's namespaces; another tenant's need an operator
(docs/security.md). Exit status: 0 done; 1 an error reply (not allowed, an invalid config
on reload: then nothing changed) or, for ``delete``, keys left in place because they were
in use (``busy``: run it again); 3 no daemon answers.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import time
from typing import Any

from tierd.cli.base import EXIT_BAD_INPUT, EXIT_OK, Command, UsageError
from tierd.cli.connection import add_socket_options, talks_to_daemon, with_client
from tierd.cli.control_text import duration, namespace_name, namespace_table
from tierd.client import Client
from tierd.control.protocol import NAMESPACE_ID_BYTES
from tierd.keys import MAX_KEY_BYTES

__all__ = ["COMMANDS"]

_EVENTS_FORM = re.compile(r"([0-9a-fA-F]{16}):((?:[0-9a-fA-F]{2})+)")  # as events prints


def _add_common(parser: argparse.ArgumentParser) -> None:
    add_socket_options(parser)
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    parser.add_argument(
        "--tenant", metavar="NAME", help="this tenant only (another tenant's: an operator)"
    )


def _add_where(parser: argparse.ArgumentParser, required: bool = True) -> None:
    _add_common(parser)
    which = parser.add_mutually_exclusive_group(required=required)
    which.add_argument("--namespace", metavar="NS", help="the namespace, by name")
    which.add_argument(
        "--namespace-id", metavar="HEX", help="the namespace by its 16-digit id (as listed)"
    )
    parser.add_argument("--hex", action="store_true", help="keys and prefixes are given in hex")


def _where(args: argparse.Namespace) -> dict[str, Any]:
    return {"namespace": args.namespace, "namespace_id": args.namespace_id, "tenant": args.tenant}


def _key(text: str, as_hex: bool) -> bytes:
    if not as_hex:
        return text.encode()
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise UsageError(f"{text!r} is not hex") from None


# -- tierd namespaces ------------------------------------------------------------------------


def _configure_namespaces(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument(
        "--all",
        action="store_true",
        help="list the namespaces that hold no block too (emptied by `tierd delete` or by"
        " eviction, or only looked up); by default they are left out",
    )


@talks_to_daemon
def _run_namespaces(args: argparse.Namespace) -> int:
    tenants = with_client(args, functools.partial(Client.namespaces, tenant=args.tenant))
    shown = tenants if args.all else {t: _holding(rows) for t, rows in tenants.items()}
    if args.json:
        print(json.dumps(shown))
        return EXIT_OK
    print(namespace_table(shown))
    left_out = sum(len(rows) for rows in tenants.values()) - sum(map(len, shown.values()))
    if left_out:
        which = "namespace that holds no block; --all lists it"
        if left_out > 1:
            which = "namespaces that hold no block; --all lists them"
        print(f"(left out: {left_out:,} {which})")
    return EXIT_OK


def _holding(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of namespaces that hold a block in some tier."""
    return [row for row in rows if any(row["blocks"].values())]


# -- tierd inspect ---------------------------------------------------------------------------


def _configure_inspect(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "key",
        help="the client's key: text, hex with --hex, or as `tierd events` prints it "
        "(NSID:HEX, its namespace then need not be named)",
    )
    _add_where(parser, required=False)


@talks_to_daemon
def _run_inspect(args: argparse.Namespace) -> int:
    key, where = _inspected(args)

    async def ask(client: Client) -> dict[str, Any]:
        as_text = len(key) <= MAX_CLIENT_KEY_BYTES  # longer: a key only as hex
        if args.hex or not _is_hex(args.key):
            return await client.inspect(key, **where)
        found = await client.inspect(key, **where) if as_text else None
        if found is not None and found["tiers"]:
            return found
        # Held nowhere as text, but it reads as hex: the form `events --namespace` prints.
        as_hex = await client.inspect(bytes.fromhex(args.key), **where)
        return {**as_hex, "read_as": "hex"} if as_hex["tiers"] or found is None else found

    found = with_client(args, ask)
    print(json.dumps(found) if args.json else _inspect_text(args.key, found))
    if found.get("namespace_known") is False:
        name = args.namespace or args.namespace_id or found["namespace_id"]
        print(
            f"tierd: namespace {name} is not known to this daemon: `tierd namespaces` lists"
            " the ones it knows",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    return EXIT_OK


def _inspected(args: argparse.Namespace) -> tuple[bytes, dict[str, Any]]:
    """The key ``inspect`` asks about, and where: the ``<namespace id>:<hex>`` form that
    ``tierd events`` prints carries its own namespace id."""
    where = _where(args)
    form = None if args.hex else _EVENTS_FORM.fullmatch(args.key)
    if form is None:
        if args.namespace is None and args.namespace_id is None:
            raise UsageError(
                "name the key's namespace (--namespace NS or --namespace-id HEX), or give "
                "the key as `tierd events` prints it (NSID:HEX)"
            )
        return _key(args.key, args.hex), where
    namespace_id, key = form.group(1).lower(), bytes.fromhex(form.group(2))
    if args.namespace_id is not None and args.namespace_id.lower() != namespace_id:
        raise UsageError(
            f"the key names namespace id {namespace_id}, --namespace-id {args.namespace_id}"
        )
    if args.namespace is None:
        where["namespace_id"] = namespace_id
    return key, where


MAX_CLIENT_KEY_BYTES = MAX_KEY_BYTES - NAMESPACE_ID_BYTES  # a key, past its namespace id


def _is_hex(text: str) -> bool:
    return len(text) % 2 == 0 and re.fullmatch(r"[0-9a-fA-F]+", text) is not None


def _inspect_text(key: str, found: dict[str, Any]) -> str:
    named = found["namespace"]
    name = namespace_name(named) if named else f"id {found['namespace_id']}"
    if not found["tiers"]:
        return f"{key} (namespace {name}): not held by any tier"
    lines = [f"{key} (namespace {name}): {found['bytes']:,} bytes"]
    if found.get("read_as") == "hex":
        lines[0] += " (held nowhere as text; read as hex, as --hex says)"
    for where in found["tiers"]:
        lines.append(
            f"  {where['tenant']}  {where['tier']} ({where['medium']})  {where['state']}"
            f"  slot {where['slot']}"
        )
    last = found.get("namespace_last_used")
    if last:
        lines.append(f"namespace last used {duration(max(0.0, time.time() - last))} ago")
    return "\n".join(lines)


# -- tierd delete ----------------------------------------------------------------------------


def _configure_delete(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--key", action="append", metavar="KEY", help="a key (repeatable)")
    what.add_argument("--prefix", metavar="P", help="every key that starts with P")
    what.add_argument("--all", action="store_true", help="the whole namespace")
    _add_where(parser)


@talks_to_daemon
def _run_delete(args: argparse.Namespace) -> int:
    keys = [_key(k, args.hex) for k in args.key] if args.key else None
    prefix = _key(args.prefix, args.hex) if args.prefix is not None else None
    if prefix == b"":
        raise UsageError("--prefix needs at least one byte (the whole namespace: --all)")
    where = _where(args)

    async def ask(client: Client) -> dict[str, Any]:
        return await client.delete(keys, prefix=prefix, everything=args.all, **where)

    done = with_client(args, ask)
    if args.json:
        print(json.dumps(done))
    else:
        named = done["namespace"] or args.namespace
        name = namespace_name(named) if named else args.namespace_id
        text = f"removed {done['removed']:,} blocks of namespace {name}"
        if done["busy"]:
            text += f"; {done['busy']:,} were in use and stayed: run it again"
        print(text)
    return EXIT_BAD_INPUT if done["busy"] else EXIT_OK


# -- tierd reload ----------------------------------------------------------------------------


def _configure_reload(parser: argparse.ArgumentParser) -> None:
    add_socket_options(parser)
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


@talks_to_daemon
def _run_reload(args: argparse.Namespace) -> int:
    done = with_client(args, Client.reload)
    if args.json:
        print(json.dumps(done))
        return EXIT_OK
    applied, restart = done["applied"], done["restart_needed"]
    print("applied: " + (", ".join(applied) if applied else "nothing changed"))
    if restart:
        print("needs a restart (still running as before): " + ", ".join(restart))
    return EXIT_OK


COMMANDS: dict[str, Command] = {
    "namespaces": Command(
        "list the namespaces: blocks per tier, bytes, hits, stores",
        _configure_namespaces,
        _run_namespaces,
    ),
    "inspect": Command("say where one key lives", _configure_inspect, _run_inspect),
    "delete": Command(
        "delete keys, a key prefix or a whole namespace from every tier",
        _configure_delete,
        _run_delete,
    ),
    "reload": Command(
        "make the daemon read its config again and apply what can change live",
        _configure_reload,
        _run_reload,
    ),
}
