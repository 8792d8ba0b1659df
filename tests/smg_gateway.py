"""SMG's relay as SMG's gateway runs it, against one publisher; run by .venv-smg's python.

``smg_grpc_servicer.kv_relay.relay`` (smg-grpc-servicer 0.14.1, scripts/setup_smg) is the
gRPC stream the gateway subscribes to: it follows the publisher's sequence, replays a
gap, and ends the stream with ``DATA_LOSS`` when it cannot (a publisher that restarted,
a replay that is not contiguous). The gateway then clears the worker and subscribes
again from zero. This script is that gateway, minus gRPC: it runs the relay with a
stand-in for the servicer context (the three calls the relay makes of it), keeps what the
relayed events say the worker holds (a block hash per tier), and on an abort clears it
and subscribes again, as the gateway does.

Usage: ``python smg_gateway.py ENDPOINT REPLAY_ENDPOINT STATE_FILE``. Every 0.1 s the
state goes to STATE_FILE (written whole, then renamed): ``{"held": [hashes], "streams":
n, "aborts": [[code, details], ...]}``. It runs until SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from smg_grpc_servicer import kv_relay


class Aborted(Exception):
    """The relay ended its stream (``context.abort``)."""


class Context:
    """What ``relay`` asks of a ``grpc.aio.ServicerContext``."""

    def __init__(self) -> None:
        self.aborted: tuple[str, str] | None = None

    def cancelled(self) -> bool:
        return False

    async def send_initial_metadata(self, metadata: Any) -> None:
        return None

    async def abort(self, code: Any, details: str) -> None:
        self.aborted = (code.name, details)
        raise Aborted(details)


class Gateway:
    def __init__(self, endpoint: str, replay: str) -> None:
        self.source = kv_relay.RankSource(rank=0, endpoint=endpoint, replay_endpoint=replay)
        self.held: set[tuple[int, int]] = set()  # (block hash, tier)
        self.streams = 0
        self.aborts: list[tuple[str, str]] = []

    async def run(self) -> None:
        while True:
            context = Context()
            self.streams += 1
            stream = kv_relay.relay(
                [self.source], kv_relay.Engine.VLLM, 0, context, recv_timeout=0.2
            )
            try:
                async for batch in stream:
                    for event in batch.events:
                        self.take(event)
            except Aborted:
                assert context.aborted is not None
                self.aborts.append(context.aborted)
                self.held.clear()  # the gateway clears the worker, then subscribes again

    def take(self, event: Any) -> None:
        kind = event.WhichOneof("data")
        if kind == "cleared":
            self.held.clear()
        elif kind == "stored":
            self.held.update((b.block_hash, event.stored.tier) for b in event.stored.blocks)
        elif kind == "removed":
            self.held.difference_update((h, event.removed.tier) for h in event.removed.block_hashes)

    def state(self) -> dict[str, Any]:
        return {
            "held": sorted({h for h, _ in self.held}),
            "streams": self.streams,
            "aborts": self.aborts,
        }


async def main(endpoint: str, replay: str, state_file: Path) -> None:
    gateway = Gateway(endpoint, replay)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    task = asyncio.create_task(gateway.run())
    while not stop.is_set() and not task.done():
        temporary = state_file.with_suffix(".tmp")
        temporary.write_text(json.dumps(gateway.state()))
        os.replace(temporary, state_file)
        await asyncio.sleep(0.1)
    if task.done():
        task.result()  # the gateway loop never ends on its own: say why it did
    task.cancel()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
