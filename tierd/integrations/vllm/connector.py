"""tierd's connector for vLLM: vLLM's ``OffloadingConnector``, whose KV events also announce
the blocks the node holds (issue 59, "mode a": every engine's own stream).

vLLM's scheduler publishes, at each step, the KV events of its prefix cache and what its
connector's ``take_events()`` returns. :class:`TierdConnector` is the offloading
connector unchanged (the same specs, tierd's pool or tierd behind vLLM's CPU tier), plus,
when the engine's KV events are on, the daemon's own stream for this user's tenant merged
in (:class:`~tierd.integrations.core.node_events.NodeEvents`): a prefix another engine stored
in tierd appears, fully described (hashes, parent, tokens, block size, medium ``CPU`` or
``DISK``), in this engine's stream, and its removal when the node lets it go. Routers
follow each engine's stream and credit the engine for it: every engine of the namespace
is credited for the node's blocks, each under its own identity.

``TIERD=1`` picks it (:mod:`tierd.integrations.vllm.plugin`); by hand::

    --kv-transfer-config '{"kv_connector": "TierdConnector",
      "kv_connector_module_path": "tierd.integrations.vllm.connector", ...}'

with the ``kv_connector_extra_config`` of either mode. ``"node_events": false`` in that
extra config leaves the engine's stream as the plain ``OffloadingConnector`` makes it.
The daemon must publish KV events (its ``kv_events:`` section); the engine announces the
node's blocks at its next step after the daemon published them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from tierd.integrations.core.node_events import NodeEvents

__all__ = ["TierdConnector", "socket_of"]

_TYPES: dict[str, type[KVCacheEvent]] = {
    cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)
}


class TierdConnector(OffloadingConnector):  # type: ignore[misc]
    """vLLM's offloading connector; its events merge in the node's (see the module)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._node: NodeEvents | None = None
        events = getattr(vllm_config, "kv_events_config", None)
        extra = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", {}))
        socket = socket_of(extra)
        if (
            role == KVConnectorRole.SCHEDULER
            and getattr(events, "enable_kv_cache_events", False) is True
            and extra.get("node_events", True) is not False
            and socket is not None
        ):
            self._node = NodeEvents(socket)

    def take_events(self) -> Iterable[KVCacheEvent]:
        own = list(super().take_events())
        if self._node is None:
            return own
        node = self._node.merge([_plain(event) for event in own])
        return own + [_event(event) for event in node]

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self._node is not None:
                self._node.close()


def socket_of(extra: dict[str, Any]) -> str | None:
    """The daemon's socket named in the connector's extra config (either mode's)."""
    tierd = extra.get("tierd")
    if isinstance(tierd, dict) and tierd.get("socket"):
        return str(tierd["socket"])
    for tier in extra.get("secondary_tiers") or ():
        if isinstance(tier, dict) and str(tier.get("module_path", "")).startswith("tierd."):
            return str(tier["socket"]) if tier.get("socket") else None
    return None


def _plain(event: Any) -> dict[str, Any]:
    """What the merge reads of one of the engine's own events."""
    return {
        "type": type(event).__name__,
        "block_hashes": list(getattr(event, "block_hashes", ()) or ()),
        "medium": getattr(event, "medium", None),
        "group_idx": getattr(event, "group_idx", None),
    }


def _event(fields: dict[str, Any]) -> KVCacheEvent:
    """One of the node's events (a decoded dict) as vLLM's own event type."""
    cls = _TYPES[str(fields["type"])]
    known = cls.__struct_fields__
    given = {name: value for name, value in fields.items() if name in known}
    return cls(**{name: None for name in _NULLABLE if name in known} | given)


# Fields without a default in vLLM's events that a stream may leave out (None there).
_NULLABLE = ("parent_block_hash", "lora_id", "medium", "lora_name")
