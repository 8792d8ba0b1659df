"""vLLM's KV cache events as its scheduler publishes them, counted in an engine process.

Run inside ``run_engine.py`` (vLLM's CPU build, one process: the scheduler is in
reach). :class:`EventCounts` stands in for the publisher of the scheduler's
``KVEventBatch`` es: what a router subscribed to vLLM's events would receive, the
connector's (the offloading manager's, so tierd's tier's) among them. tierd's tier is
configured with the ``STORAGE`` medium, vLLM's own CPU tier says ``CPU``: the counts are
by medium and KV cache group, one per block hash.

:func:`drain` keeps the scheduler stepping (a one-token request with no full block: no
lookup, no store), once at least, until tierd's tier has no job left and the removed
``STORAGE`` blocks reach the daemon's evictions from its last tier, or a bound: vLLM takes
events from its connector only when it steps, and tierd's tier decides a removal that
arrived during the job that stored it a grace after.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

DRAIN_ROUNDS = 60  # bounded: each round waits at most a second for a push of the daemon
DRAIN_BOUND_S = 60.0  # a safety net on a loaded machine, not a timing


class EventCounts:
    """Stands in for the scheduler's publisher: counts each batch's block events."""

    def __init__(self) -> None:
        self.stored: Counter[tuple[str, int]] = Counter()
        self.removed: Counter[tuple[str, int]] = Counter()

    def publish(self, batch: Any) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        for event in batch.events:
            if isinstance(event, BlockStored | BlockRemoved):
                into = self.stored if isinstance(event, BlockStored) else self.removed
                into[(str(event.medium), int(event.group_idx or 0))] += len(event.block_hashes)

    def shutdown(self) -> None:
        return

    def removed_in(self, medium: str) -> int:
        """Blocks told removed from ``medium`` (tierd's: STORAGE as a secondary tier,
        CPU as vLLM's CPU tier)."""
        return sum(n for (told, _), n in self.removed.items() if told == medium)

    def summary(self) -> dict[str, Any]:
        """Per medium, per KV cache group (as strings, for JSON): stored and removed."""

        def table(counts: Counter[tuple[str, int]]) -> dict[str, dict[str, int]]:
            out: dict[str, dict[str, int]] = {}
            for (medium, group), n in sorted(counts.items()):
                out.setdefault(medium, {})[str(group)] = n
            return out

        return {"stored": table(self.stored), "removed": table(self.removed)}


def install(llm: Any) -> EventCounts:
    """Count what ``llm``'s scheduler publishes (its engine core runs in this process)."""
    counts = EventCounts()
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    scheduler.kv_event_publisher = counts
    return counts


async def _daemon_drops(socket_path: str) -> int:
    """The blocks the daemon let go of from its last tier (the chain's drops)."""
    from tierd.client import Client

    async with await Client.connect(socket_path) as client:
        stats = await client.stats()
    return int(stats["tiers"][-1]["evictions"])


def drain(llm: Any, counts: EventCounts, socket_path: str) -> dict[str, Any]:
    """Step the engine until tierd's tier has no job left and its removed events reach
    the daemon's drops (bounded); the counts, the drops and how many rounds it took."""
    from run_engine import tiers
    from vllm import SamplingParams, TokensPrompt

    (tier,) = tiers()  # tierd's secondary tier (its medium STORAGE), or its pool's manager
    residency = tier.report.residency
    medium = tier.report.medium.name  # the name vLLM's events carry (CPU, STORAGE)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    give_up = time.monotonic() + DRAIN_BOUND_S
    rounds = 0
    drops = asyncio.run(_daemon_drops(socket_path))
    # One round at least: a job that ended in the last step is taken at the next.
    while rounds == 0 or tier.has_pending_work() or counts.removed_in(medium) < drops:
        if rounds >= DRAIN_ROUNDS or time.monotonic() > give_up:
            break
        rounds += 1
        llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), params, use_tqdm=False)
        if residency is not None and counts.removed_in(medium) < drops:
            residency.wait_pushes(residency.pushes + 1, min(1.0, residency.grace_s))
        drops = asyncio.run(_daemon_drops(socket_path))
    return {"drops": drops, "rounds": rounds, "jobs_left": tier.has_pending_work()} | (
        counts.summary()
    )
