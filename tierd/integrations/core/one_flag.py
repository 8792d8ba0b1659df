"""tierd turned on by one environment variable: what ``TIERD`` means, which socket it
names, and the engine configs it stands for (no engine imports).

``TIERD`` unset, empty, ``0``, ``off``, ``false`` or ``no``: tierd stays off and nothing of
the engine changes. ``1``, ``on``, ``true`` or ``yes``: on, with the socket a client command
would use (``TIERD_SOCKET``, else the ``socket.path`` of ``$TIERD_CONFIG``, else
``TIERD_SOCKET__PATH``, else the daemon's default path). An absolute path: on, with that
socket. Anything else is refused with what to write instead.

The engines' plugin seams use it (:mod:`tierd.integrations.vllm.plugin` for vLLM's
``vllm.general_plugins``; :func:`register_sglang` for SGLang's ``sglang.srt.plugins``), and
``tierd engine-config`` prints the same configs for those who paste them. The configs are
built here once, so that the printed flags and what the variable turns on never differ.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierd.control.socketfile import (
    CONFIG_ENV,
    SOCKET_PATH_ENV,
    default_socket_path,
    socket_path_setting,
)

__all__ = [
    "SWITCH_ENV",
    "VLLM_CONNECTOR",
    "VLLM_CPU_BYTES",
    "VLLM_MODE_ENV",
    "VllmMode",
    "choose_vllm_mode",
    "vllm_pool_config",
    "fill_in_sglang",
    "missing_daemon",
    "register_sglang",
    "Switch",
    "SwitchInvalid",
    "read_switch",
    "resolve_socket",
    "sglang_extra_config",
    "start_hint",
    "vllm_transfer_config",
]

SWITCH_ENV = "TIERD"
SOCKET_ENV = "TIERD_SOCKET"
VLLM_MODE_ENV = "TIERD_VLLM_MODE"  # pool, secondary, or auto (the default)
_PROBE_S = 1.0  # how long the choice of mode waits for the daemon's hello
# vLLM's own CPU tier under tierd when neither the variable's user nor vLLM's
# --kv-offloading-size says: one staging level in front of the daemon, populated at start.
VLLM_CPU_BYTES = 4 << 30
_ON = frozenset({"1", "on", "true", "yes"})
_OFF = frozenset({"", "0", "off", "false", "no"})


class SwitchInvalid(ValueError):
    """``TIERD`` holds something that is neither on, off nor a socket path."""


@dataclass(frozen=True, slots=True)
class Switch:
    """tierd is on, talking to the daemon at ``socket`` (``source`` says who named it)."""

    socket: str
    source: str


def resolve_socket(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The socket a client command would use, and what named it: ``TIERD_SOCKET``, else
    the ``socket.path`` of ``$TIERD_CONFIG``, else ``TIERD_SOCKET__PATH``, else the
    daemon's default path."""
    env = os.environ if environ is None else environ
    if env.get(SOCKET_ENV):
        return env[SOCKET_ENV], SOCKET_ENV
    if env.get(CONFIG_ENV):
        from tierd.settings import load_settings  # the config models: only when named

        return str(load_settings(env[CONFIG_ENV], environ=env).socket.path), CONFIG_ENV
    moved = socket_path_setting(env)
    if moved is not None:
        return moved, SOCKET_PATH_ENV
    return str(default_socket_path(env)), "the default path"


def read_switch(environ: Mapping[str, str] | None = None) -> Switch | None:
    """What ``TIERD`` asks for: None (off), or on with its socket; :class:`SwitchInvalid`
    for a value that is neither."""
    env = os.environ if environ is None else environ
    raw = env.get(SWITCH_ENV, "")
    value = raw.strip()
    if value.lower() in _OFF:
        return None
    if value.lower() in _ON:
        return Switch(*resolve_socket(env))
    if value.startswith("/"):
        return Switch(value, SWITCH_ENV)
    raise SwitchInvalid(
        f"{SWITCH_ENV}={raw!r}: expected 1 (tierd on, at the default socket or "
        f"${SOCKET_ENV}), 0 (off), or the daemon's socket as an absolute path"
    )


def start_hint(socket: str) -> str:
    """How to get a daemon answering on ``socket``."""
    if socket == str(default_socket_path()):
        return "start it with `tierd serve`"
    return (
        f"start one there with `tierd serve --set socket.path={socket}`, or name the socket"
        " of the running one"
    )


# vLLM's offloading connector whose KV events also announce the node's blocks
# (tierd.integrations.vllm.connector): the connector of both modes.
VLLM_CONNECTOR = {
    "kv_connector": "TierdConnector",
    "kv_connector_module_path": "tierd.integrations.vllm.connector",
}


def vllm_transfer_config(
    socket: str,
    *,
    namespace: str | None = None,
    cpu_bytes: int = VLLM_CPU_BYTES,
    cpu_build: bool = False,
) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` with tierd as the secondary tier of its offloading.
    ``cpu_build``: vLLM's CPU build, whose own offload worker refuses the platform, gets
    tierd's plain-torch copy worker (:mod:`tierd.integrations.vllm.cpu_spec`)."""
    tier: dict[str, Any] = {
        "type": "TierdSecondaryTier",
        "module_path": "tierd.integrations.vllm",
        "socket": socket,
    }
    if namespace:
        tier["namespace"] = namespace
    extra: dict[str, Any] = {"spec_name": "TieringOffloadingSpec"}
    if cpu_build:
        extra = {
            "spec_name": "TierdCpuTieringSpec",
            "spec_module_path": "tierd.integrations.vllm.cpu_spec",
        }
    extra.update(cpu_bytes_to_use=cpu_bytes, secondary_tiers=[tier])
    return {**VLLM_CONNECTOR, "kv_role": "kv_both", "kv_connector_extra_config": extra}


def vllm_pool_config(socket: str, *, namespace: str | None = None) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` with tierd's pool as vLLM's CPU tier (one copy of
    each prefix on the node: :mod:`tierd.integrations.vllm.pool_spec`); the same on vLLM's GPU
    and CPU builds."""
    tierd: dict[str, Any] = {"socket": socket}
    if namespace:
        tierd["namespace"] = namespace
    return {
        **VLLM_CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TierdPoolSpec",
            "spec_module_path": "tierd.integrations.vllm.pool_spec",
            "tierd": tierd,
        },
    }


@dataclass(frozen=True, slots=True)
class VllmMode:
    """How tierd goes under vLLM: ``pool`` (tierd's pool is vLLM's CPU tier) or
    ``secondary`` (behind vLLM's own CPU tier), and why that one."""

    name: str
    why: str


def choose_vllm_mode(socket: str, environ: Mapping[str, str] | None = None) -> VllmMode:
    """``TIERD_VLLM_MODE`` (``pool``, ``secondary``), else ``auto``: the pool when the
    daemon at ``socket`` answers with a shared-memory pool for this user (its entry
    tier is a CPU tier), else the secondary tier (vLLM keeps a CPU tier of its own: a
    daemon that is down or has no pool costs it nothing). A wrong value is refused."""
    env = os.environ if environ is None else environ
    asked = env.get(VLLM_MODE_ENV, "").strip().lower() or "auto"
    if asked in ("pool", "secondary"):
        return VllmMode(asked, f"{VLLM_MODE_ENV}={asked}")
    if asked != "auto":
        raise SwitchInvalid(f"{VLLM_MODE_ENV}={asked!r}: expected pool, secondary or auto")
    from tierd.control.clients.blocking_client import BlockingClient  # the engine's start only
    from tierd.errors import TierdError

    try:
        client = BlockingClient.connect(
            socket, namespace=None, block_bytes=None, deadline=time.monotonic() + _PROBE_S
        )
    except (TierdError, OSError) as exc:
        return VllmMode("secondary", f"no daemon answers at {socket} ({exc})")
    try:
        pooled = client.info.get("pool") is not None
    finally:
        client.close()
    if pooled:
        return VllmMode("pool", "the daemon serves a shared-memory pool")
    return VllmMode("secondary", "the daemon's entry tier is not a shared-memory pool")


def sglang_extra_config(socket: str, *, namespace: str | None = None) -> dict[str, Any]:
    """SGLang's ``--hicache-storage-backend-extra-config`` for tierd's HiCache backend."""
    extra: dict[str, Any] = {
        "backend_name": "tierd",
        "module_path": "tierd.integrations.sglang",
        "class_name": "TierdHiCache",
        "interface_v1": 1,
        "allocator": "shm",
        "hicache_storage_pass_prefix_keys": True,
        "socket": socket,
    }
    if namespace:
        extra["namespace"] = namespace
    return extra


def missing_daemon(socket: str, exc: BaseException) -> str:
    """The start-up line of an engine whose daemon does not answer: the path it tried,
    why, what that costs, and how to start the daemon."""
    cause = exc if isinstance(exc, OSError) else exc.__cause__
    number = cause.errno if isinstance(cause, OSError) else None
    if number == errno.ENOENT:
        why = "no socket there"
    elif number == errno.ECONNREFUSED:
        why = "the socket is there but no daemon listens on it"
    else:
        why = str(exc) or type(exc).__name__
    return (
        f"tierd: no daemon answers at {socket} ({why}): this engine runs without tierd, "
        f"every lookup a miss, until one answers there; {start_hint(socket)}"
    )


def register_sglang() -> None:
    """SGLang's general plugin (entry point group ``sglang.srt.plugins``): with ``TIERD``
    on, a hook before ``ServerArgs.resolve_once`` (which every launcher calls before the
    arguments are used, in the process that parsed them) fills in tierd's HiCache flags
    when no storage backend was given. With ``TIERD`` off it does nothing at all."""
    if read_switch() is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.resolve_once", fill_in_sglang, HookType.BEFORE
    )


def fill_in_sglang(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """Give SGLang's ``server_args`` tierd's HiCache flags if ``TIERD`` is on and the user
    chose no storage backend (one already resolved is left alone)."""
    switch = read_switch()
    if switch is None or getattr(server_args, "_resolution_finished", False):
        return
    log = logging.getLogger("tierd.integrations.sglang")  # SGLang configures the root
    if server_args.hicache_storage_backend is not None:
        log.info("TIERD is set, but --hicache-storage-backend was given: that one is used")
        return
    server_args.enable_hierarchical_cache = True
    server_args.hicache_storage_backend = "dynamic"
    server_args.hicache_storage_backend_extra_config = json.dumps(
        sglang_extra_config(switch.socket)
    )
    log.info(
        "tierd on (TIERD): HiCache storage backend at %s (socket from %s)",
        switch.socket,
        switch.source,
    )
