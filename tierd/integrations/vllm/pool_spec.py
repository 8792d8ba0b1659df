"""tierd's pool as every vLLM engine's CPU tier: one copy of each prefix on the node.

vLLM's KV offloading keeps a CPU tier per engine (``CPUOffloadingSpec``: a shared
region of the engine's own, and a manager that decides what lives there). With
:class:`TierdPoolSpec` the CPU tier of every engine is the daemon's pool: the daemon
decides hits, placement, eviction and demotion to its disk tier, and a block one engine
stored is at once a CPU-tier hit for every engine of the same namespace. vLLM's own
copies move the bytes straight between its KV cache and rows of the mapped pool
(:mod:`tierd.integrations.vllm.pool_worker`): no staging file, no second copy, no CPU
region of the engine's own. vLLM loads the spec by name::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TierdPoolSpec",
        "spec_module_path": "tierd.integrations.vllm.pool_spec",
        "tierd": {"socket": "/run/tierd/tierd.sock"}}}'

(or ``TIERD=1``: :mod:`tierd.integrations.vllm.plugin` picks this mode when the daemon
serves a pool). This module is the spec: its options (the ``tierd`` entry) and the
geometry of a row. The scheduler's side is :mod:`tierd.integrations.vllm.pool_manager`
(with the rows it hands vLLM, naming the pool they lie in), the workers'
:mod:`tierd.integrations.vllm.pool_worker`. No row is handed out but under a lease, and
no lease ends while vLLM's copy may run: the rule and each fault are in ``docs/vllm.md``
("tierd's pool as vLLM's CPU tier").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import (
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
)

from tierd.config import default_socket_path
from tierd.integrations.core.link import LinkSettings
from tierd.integrations.core.naming import derive_namespace
from tierd.integrations.core.params import checked_params
from tierd.integrations.vllm.tier_report import TierReport
from tierd.logs import get_logger

if TYPE_CHECKING:
    pass

__all__ = ["PoolOptions", "TierdPoolSpec"]

log = get_logger("tierd.integrations.vllm")
engine_log = logging.getLogger("vllm.tierd")  # vLLM's own format and level

ROW_ALIGNMENT = 4096  # vLLM's CPU tier rounds its rows up to a page: tierd's block is one


@dataclass(frozen=True, slots=True)
class PoolOptions:
    """The ``tierd`` entry of the spec's extra config (every key optional)."""

    socket: str | None = None
    namespace: str | None = None
    lookup_deadline_s: float = 0.05
    load_deadline_s: float = 0.5
    job_deadline_s: float = 0.05
    breaker_failures: int = 3
    probe_interval_s: float = 0.5
    connect_timeout_s: float = 5.0
    reconnect_max_s: float = 10.0
    enable_kv_events: bool = False
    server_uids: tuple[int, ...] = ()

    @classmethod
    def of(cls, extra: Any) -> PoolOptions:
        """The options in ``extra`` (vLLM's ``kv_connector_extra_config``), under the
        key ``tierd``; an unknown option or a deadline not above 0 is refused."""
        given = dict(extra.get("tierd") or {}) if extra is not None else {}
        checked = checked_params(
            cls,
            given,
            owner="the tierd pool config",
            unknown_what="unknown keys in the tierd pool config",
            doc="docs/vllm.md",
            positive=("lookup_deadline_s", "load_deadline_s", "job_deadline_s"),
        )
        return cls(**checked)


class TierdPoolSpec(OffloadingSpec):  # type: ignore[misc]
    """vLLM's offloading spec whose CPU tier is tierd's pool (no region of its own)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.options = PoolOptions.of(self.extra_config)
        # Every rank maps the pool, as every rank maps vLLM's own shared region: a
        # layout the engine says is the same on every rank is kept once (rank 0's).
        self.replicated_layout = bool(getattr(config, "replicated_layout", False))
        world = max(int(config.parallel.world_size), 1)
        copies = 1 if self.replicated_layout else world
        self.cpu_page_size_per_worker = int(config.worker_kv_bytes_per_block) * int(
            self.blocks_per_chunk
        )
        # One row of vLLM's own CPU tier (every rank's part, rounded up to a page): the
        # daemon's block. The same size and namespace as tierd as vLLM's secondary tier,
        # so engines of both modes share their blocks.
        unaligned = self.cpu_page_size_per_worker * copies
        self.kv_bytes_per_chunk = -(-unaligned // ROW_ALIGNMENT) * ROW_ALIGNMENT
        self._manager: OffloadingManager | None = None
        self._worker: Any = None

    @property
    def namespace(self) -> str:
        return derive_namespace(self, self.kv_bytes_per_chunk, self.options.namespace)

    def settings(self) -> LinkSettings:
        o = self.options
        return LinkSettings(
            str(o.socket) if o.socket else str(default_socket_path()),
            self.namespace,
            self.kv_bytes_per_chunk,
            o.reconnect_max_s,
            o.server_uids,
            lookup_deadline_s=o.lookup_deadline_s,
            job_deadline_s=o.job_deadline_s,
            load_deadline_s=o.load_deadline_s,
            breaker_failures=o.breaker_failures,
            probe_interval_s=o.probe_interval_s,
        )

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            from tierd.integrations.vllm.pool_manager import TierdPoolManager

            self._manager = TierdPoolManager(self)
        return self._manager

    def get_worker(self, kv_caches: Any) -> Any:
        if self._worker is None:
            from tierd.integrations.vllm.pool_worker import TierdPoolWorker

            self._worker = TierdPoolWorker(self, kv_caches)
        return self._worker

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return TierReport.definitions()
