"""vLLM's general plugin: ``TIERD=1`` puts tierd under ``vllm serve`` with no JSON.

vLLM runs every ``vllm.general_plugins`` entry point in each of its processes, first in
``EngineArgs.__post_init__`` (and, for ``vllm serve``, while it builds its argument
parser), that is before ``EngineArgs.create_engine_config`` builds the ``VllmConfig``
the engine core and its workers receive. :func:`register` wraps that method, once per
process: when ``TIERD`` is on (:mod:`tierd.integrations.core.one_flag`) and the user gave no
``--kv-transfer-config`` (nor another offloading backend), it fills in the config
``tierd engine-config vllm`` prints, with the socket resolved here, in the process that
parses the flags. The engine core and the workers get the finished config; the wrapper is
installed there too but never called.

The seam and its risk: the wrapper replaces a method of vLLM's ``EngineArgs`` class. A
vLLM that builds its config elsewhere would not see it (then tierd is simply not on, and
this logs nothing); one that renames the fields it reads (``kv_transfer_config``,
``kv_offloading_size``, ``kv_offloading_backend``) fails loudly at start-up, only while
``TIERD`` is on. With ``TIERD`` unset :func:`register` returns before importing vLLM.

Once the config is built, and before any weight loads, the wrapper asks the daemon
whether it serves the engine's block size (:mod:`tierd.integrations.vllm.block_size`): a
daemon that does not stops the start in one line that says what to change.

vLLM's ``--kv-offloading-size GiB`` (its native backend) sizes vLLM's own CPU tier in front
of tierd; without it the tier is :data:`~tierd.integrations.core.one_flag.VLLM_CPU_BYTES`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from tierd.integrations.core.one_flag import (
    VLLM_MODE_ENV,
    VllmMode,
    choose_vllm_mode,
    read_switch,
    vllm_pool_config,
    vllm_transfer_config,
)

__all__ = ["fill_in", "register"]

# A child of vLLM's own logger: its handler, format and level apply.
log = logging.getLogger("vllm.tierd")
_MARK = "_tierd_wrapped"


def register() -> None:
    """The entry point: wrap ``EngineArgs.create_engine_config`` when ``TIERD`` is on."""
    if read_switch() is None:
        return
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, _MARK, False):
        return  # plugins may load more than once in a process
    EngineArgs.create_engine_config = _wrapped(original)


def _wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        filled = fill_in(self)
        config = original(self, *args, **kwargs)
        switch = read_switch()
        if filled and switch is not None:  # before the weights load: a size refused stops
            from tierd.integrations.vllm.block_size import SizeRefused, check_block_size, refuse

            try:
                check_block_size(config, switch.socket)
            except SizeRefused as exc:
                refuse(exc)
        return config

    setattr(create_engine_config, _MARK, True)
    return create_engine_config


def fill_in(engine_args: Any) -> bool:
    """Give ``engine_args`` tierd's transfer config if ``TIERD`` is on and the user chose
    no other; whether it did. The switch is read again: a refused value stops here. The
    mode is :func:`~tierd.integrations.core.one_flag.choose_vllm_mode`'s: tierd's pool as vLLM's
    CPU tier when the daemon serves one, else tierd behind vLLM's own CPU tier; a
    ``--kv-offloading-size`` sizes vLLM's own CPU tier, so it asks for the second."""
    switch = read_switch()
    if switch is None:
        return False
    if engine_args.kv_transfer_config is not None:
        log.info("TIERD is set, but --kv-transfer-config was given: that one is used as is")
        return False
    backend = getattr(engine_args, "kv_offloading_backend", "native")
    size = getattr(engine_args, "kv_offloading_size", None)
    if size is not None and backend != "native":
        log.info("TIERD is set, but --kv-offloading-backend %s was asked for: tierd off", backend)
        return False
    from vllm.config import KVTransferConfig
    from vllm.platforms import current_platform

    mode = choose_vllm_mode(switch.socket)
    if mode.name == "pool" and size is not None and not mode.why.startswith(VLLM_MODE_ENV):
        mode = VllmMode("secondary", "--kv-offloading-size sizes vLLM's own CPU tier")
    if mode.name == "pool":
        config = vllm_pool_config(switch.socket)
        engine_args.kv_transfer_config = KVTransferConfig(**config)
        log.info(
            "tierd on (TIERD): tierd's pool is vLLM's CPU tier at %s (socket from %s; %s):"
            " one copy of each prefix on the node, no CPU tier of vLLM's own",
            switch.socket,
            switch.source,
            mode.why,
        )
        return True
    config = vllm_transfer_config(switch.socket, cpu_build=current_platform.is_cpu())
    engine_args.kv_transfer_config = KVTransferConfig(**config)
    extra = config["kv_connector_extra_config"]
    log.info(
        "tierd on (TIERD): secondary KV tier at %s (socket from %s; %s); vLLM's CPU tier %s",
        switch.socket,
        switch.source,
        mode.why,
        f"{size} GiB (--kv-offloading-size)"
        if size is not None
        else f"{extra['cpu_bytes_to_use']} bytes (--kv-offloading-size GiB to change)",
    )
    return True
