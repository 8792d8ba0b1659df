"""The size of a vLLM engine's tierd blocks, known from its config before its weights load,
and the daemon asked whether it serves that size.

vLLM's offloading hands tierd one chunk per block: every rank's part of one chunk of
GPU blocks, rounded up to a page (``worker_kv_bytes_per_block x copies x
blocks_per_chunk``, rounded to 4096: vLLM's CPU tier and tierd's pool spec both). vLLM
learns ``worker_kv_bytes_per_block`` only once the KV cache is allocated, after the
weights load and the warm-up; on a standard decoder (full attention in every layer, no
MLA) it is already fixed by the config: ``2 (K and V) x block_size x KV heads per rank x
head size x dtype bytes`` per layer. :func:`predicted_block_bytes` computes that, and
None for any other shape (hybrid, sliding-window, MLA, attention-free: their layout is
vLLM's own business, checked when the engine connects instead).

:func:`check_block_size` asks the daemon, with the hello the engine will send anyway:
served, or refused with the daemon's words. With ``TIERD`` on,
:mod:`tierd.integrations.vllm.plugin` runs it as the config is built, so that a daemon
that does not serve the engine's size stops the start at once, in one line.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from tierd.integrations.core.params import size_advice

__all__ = ["SizeRefused", "check_block_size", "predicted_block_bytes", "refuse"]

log = logging.getLogger("vllm.tierd")

PAGE = 4096  # vLLM's CPU tier and tierd's pool round a chunk up to a page
_PLAIN_DTYPES = frozenset({"auto", "bfloat16", "float16", "half", "float", "float32"})
_ASK_S = 2.0  # the daemon's answer to one hello, at most


class SizeRefused(ValueError):
    """The daemon at the engine's socket does not serve its block size."""


def predicted_block_bytes(vllm_config: Any) -> int | None:
    """The bytes of one of this engine's tierd blocks, from ``vllm_config`` (vLLM's
    ``VllmConfig``) alone; None for a shape whose layout this does not predict."""
    model, cache, parallel = (
        vllm_config.model_config,
        vllm_config.cache_config,
        vllm_config.parallel_config,
    )
    if model is None or cache.block_size is None:
        return None
    if model.use_mla or model.is_hybrid or model.is_attention_free:
        return None
    if model.get_sliding_window() is not None or getattr(model, "has_noops", False):
        return None
    if str(cache.cache_dtype) not in _PLAIN_DTYPES:
        return None  # a quantized cache (fp8, with scales or not): vLLM's own layout
    from vllm.utils.torch_utils import get_kv_cache_torch_dtype

    dtype = get_kv_cache_torch_dtype(cache.cache_dtype, model.dtype)
    per_layer = 2 * cache.block_size * model.get_num_kv_heads(parallel) * model.get_head_size()
    per_rank = per_layer * dtype.itemsize * model.get_num_layers(parallel)
    extra = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", {}) or {})
    if extra.get("blocks_per_chunk") is not None:
        blocks = int(extra["blocks_per_chunk"])
    else:
        tokens = int(extra.get("block_size") or cache.block_size)
        if tokens % cache.block_size:
            return None  # vLLM refuses it itself
        blocks = tokens // cache.block_size
    chunk = per_rank * max(int(parallel.world_size), 1) * blocks
    return int(-(-chunk // PAGE) * PAGE)


def check_block_size(vllm_config: Any, socket: str) -> int | None:
    """Ask the daemon at ``socket`` whether it serves this engine's blocks; the size asked
    about, or None when the shape is not predicted or no daemon answers (the engine
    starts, and its connector checks again). :class:`SizeRefused`, in one line saying
    what to change, when the daemon refuses the size."""
    wanted = predicted_block_bytes(vllm_config)
    if wanted is None:
        log.info("tierd: this model's block size is checked when the engine connects")
        return None
    from tierd.control.clients.blocking_client import BlockingClient
    from tierd.control.clients.handshake import DaemonError
    from tierd.errors import TierdError

    try:
        client = BlockingClient.connect(
            socket, namespace=None, block_bytes=wanted, deadline=time.monotonic() + _ASK_S
        )
    except DaemonError as exc:
        if exc.code != "block_size_mismatch":
            return None  # busy, stopping, not admitted: the connector says so itself
        raise SizeRefused(
            f"tierd at {socket} does not serve this engine's blocks of {wanted} bytes"
            f" ({exc}): {size_advice(wanted)}"
        ) from None
    except (TierdError, OSError):
        return None
    client.close()
    return wanted


def refuse(exc: SizeRefused) -> None:
    """End the start with ``exc``'s one line: ``vllm serve`` exits 1 with it and no
    traceback; an engine built in Python gets the exception."""
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    command = getattr(main, "name", "").startswith("vllm.") or (
        os.path.basename(sys.argv[0]) == "vllm" if sys.argv else False
    )
    if command or "vllm.entrypoints.cli.main" in sys.modules:
        raise SystemExit(f"ERROR {exc}") from None
    raise exc
