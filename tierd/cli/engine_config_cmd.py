"""``tierd engine-config vllm|sglang``: the flags to paste into an engine for this daemon.

The socket is found as every client command finds it (:mod:`tierd.cli.connection`:
``--socket``, ``TIERD_SOCKET``, the config's ``socket.path``, ``TIERD_SOCKET__PATH``, the
default path), so the
printed flags name the socket the daemon really serves. The daemon is then asked for its
block size: the engine's row (vLLM) or page (SGLang) must be that many bytes, which the
engine checks at start-up, unless the daemon serves several sizes (``block_sizes``). A
daemon that does not answer is a warning on stderr, with the path tried and how to start
one; the flags are printed all the same (exit status 0), for a daemon started later.

The configs are :mod:`tierd.integrations.core.one_flag`'s, the very ones ``TIERD=1`` turns on
inside vLLM. For vLLM there are two: tierd's pool as vLLM's CPU tier (``pool``: one copy
of each prefix on the node) and tierd behind vLLM's own CPU tier (``secondary``); both
are printed, ``--mode`` picks one. ``--json`` prints only the JSON value to paste
(vLLM's ``--kv-transfer-config``, the pool's unless ``--mode secondary``; SGLang's
``--hicache-storage-backend-extra-config``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from tierd.cli.base import EXIT_OK, Command
from tierd.cli.connection import (
    CannotReach,
    add_socket_options,
    socket_path,
    trusted_uids,
    with_client,
)
from tierd.client import Client, DaemonError
from tierd.control.socketfile import default_socket_path
from tierd.integrations.core.one_flag import (
    SWITCH_ENV,
    VLLM_CPU_BYTES,
    VLLM_MODE_ENV,
    sglang_extra_config,
    vllm_pool_config,
    vllm_transfer_config,
)

__all__ = ["COMMANDS"]

ENGINES = ("vllm", "sglang")
MODES = ("pool", "secondary")
_MODE_TITLE = {
    "pool": "tierd's pool as vLLM's CPU tier (one copy of each prefix on the node)",
    "secondary": "tierd behind vLLM's own CPU tier (a secondary tier)",
}
_ROW = {"vllm": "one row of vLLM's CPU tier", "sglang": "one page of SGLang's host pool"}


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("engine", choices=ENGINES, help="the engine to configure")
    add_socket_options(parser)
    parser.add_argument("--model", default="MODEL", help="the model to name in the command")
    parser.add_argument(
        "--namespace", help="a prefix of the engine's derived namespace (a tenant's name, say)"
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        help="vLLM only: tierd's pool as vLLM's CPU tier, or tierd behind vLLM's own (both"
        " are printed without it; --json prints the pool's)",
    )
    parser.add_argument(
        "--cpu-bytes",
        type=int,
        default=VLLM_CPU_BYTES,
        metavar="BYTES",
        help=f"vLLM's secondary mode only: its own CPU tier in front of tierd (default"
        f" {VLLM_CPU_BYTES})",
    )
    parser.add_argument(
        "--cpu-build",
        action="store_true",
        help="vLLM only: for vLLM's CPU build (tierd's torch-copy spec; TIERD=1 picks it there)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON to paste")


def engine_json(args: argparse.Namespace, socket: str, mode: str = "pool") -> dict[str, Any]:
    """The JSON value the engine takes, for this daemon's socket (vLLM: in ``mode``)."""
    uids = list(trusted_uids(args))
    if args.engine == "vllm" and mode == "pool":
        config = vllm_pool_config(socket, namespace=args.namespace)
        if uids:
            config["kv_connector_extra_config"]["tierd"]["server_uids"] = uids
        return config
    if args.engine == "vllm":
        config = vllm_transfer_config(
            socket, namespace=args.namespace, cpu_bytes=args.cpu_bytes, cpu_build=args.cpu_build
        )
        if uids:
            config["kv_connector_extra_config"]["secondary_tiers"][0]["server_uids"] = uids
        return config
    extra = sglang_extra_config(socket, namespace=args.namespace)
    if uids:
        extra["server_uids"] = uids
    return extra


def command_lines(args: argparse.Namespace, socket: str) -> list[str]:
    """The shell lines to paste: the command with its flags (for vLLM, each mode's, and
    the one variable that does the same once tierd is installed in vLLM's environment)."""
    model = shlex.quote(args.model)
    if args.engine == "sglang":
        text = shlex.quote(json.dumps(engine_json(args, socket)))
        return [
            f"python -m sglang.launch_server --model-path {model} --page-size 64 \\",
            "  --enable-hierarchical-cache --hicache-mem-layout page_first \\",
            "  --hicache-storage-backend dynamic \\",
            f"  --hicache-storage-backend-extra-config {text}",
        ]
    lines: list[str] = []
    for mode in (args.mode,) if args.mode else MODES:
        text = shlex.quote(json.dumps(engine_json(args, socket, mode)))
        lines += [f"# {_MODE_TITLE[mode]}:", f"vllm serve {model} --kv-transfer-config {text}"]
    switch = "1" if socket == str(default_socket_path()) else shlex.quote(socket)
    defaults = args.namespace is None and not trusted_uids(args)
    if defaults and args.cpu_bytes == VLLM_CPU_BYTES:
        pick = f"{VLLM_MODE_ENV}={args.mode} " if args.mode else ""
        lines += [
            "# the same, with tierd installed in vLLM's environment (docs/vllm.md): the pool"
            f" when the daemon serves one; {VLLM_MODE_ENV}=pool|secondary picks one",
            f"{pick}{SWITCH_ENV}={switch} vllm serve {model}",
        ]
    return lines


def _check(args: argparse.Namespace, socket: str) -> None:
    """Say on stderr what the daemon at ``socket`` serves, or that none answers there."""

    async def ask(client: Client) -> tuple[int, int]:
        return client.block_bytes, int(client.info.get("block_sizes") or 1)

    try:
        block_bytes, sizes = with_client(args, ask)
    except CannotReach as exc:
        print(
            f"tierd: warning: {exc}. The flags name this socket all the same, for a daemon"
            " started there.",
            file=sys.stderr,
        )
        return
    except DaemonError as exc:
        print(f"tierd: warning: the daemon at {socket} answered: {exc}", file=sys.stderr)
        return
    if sizes > 1:
        print(
            f"tierd: the daemon at {socket} answers; it serves up to {sizes} block sizes"
            f" (block_sizes): {_ROW[args.engine]} is served at its own size, nothing to set",
            file=sys.stderr,
        )
        return
    print(
        f"tierd: the daemon at {socket} answers; its block_bytes is {block_bytes}: "
        f"{_ROW[args.engine]} must be that size (the engine refuses to start otherwise, "
        "naming the size to set)",
        file=sys.stderr,
    )


def _run(args: argparse.Namespace) -> int:
    socket = socket_path(args)
    _check(args, socket)
    if args.json:
        print(json.dumps(engine_json(args, socket, args.mode or "pool"), indent=2))
    else:
        print("\n".join(command_lines(args, socket)))
    return EXIT_OK


COMMANDS: dict[str, Command] = {
    "engine-config": Command(
        "print the flags that put this daemon under vLLM or SGLang", _configure, _run
    ),
}
