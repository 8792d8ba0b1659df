"""The daemon's event-loop turns, counted: the turns a module's loop gives (patched in), which of
two requests was answered first, and the keys and rows of the loop-bound tests."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tierd.client import Client
from tierd.daemon import Daemon

BLOCK = 1024


def names(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(count)]


def rows_of(keys: list[bytes]) -> list[bytes]:
    return [bytes([len(k) % 251]) * BLOCK for k in keys]


async def connect(daemon: Daemon, namespace: str | None) -> Client:
    return await Client.connect(
        str(daemon.config.socket.path), namespace=namespace, block_bytes=BLOCK
    )


def turns_given(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[int]:
    """Count the turns ``module`` gives the loop (its ``next_turn`` calls), from now on:
    ``[count]``, reset by the caller as it likes."""
    given = [0]
    real_turn = module.next_turn

    async def counted() -> None:
        given[0] += 1
        await real_turn()

    monkeypatch.setattr(module, "next_turn", counted)
    return given


async def answered_first(
    big: asyncio.Future[dict[str, Any]], small: asyncio.Future[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The replies to ``big`` and to ``small`` (sent after it), once both came; checks
    that ``small``'s came first."""
    order: list[str] = []
    big.add_done_callback(lambda _: order.append("big"))
    small.add_done_callback(lambda _: order.append("bystander"))
    replies = await big, await small
    assert order == ["bystander", "big"]
    return replies
