"""The link's lines for an engine's operator (``tierd.integrations.core.link``: the daemon lost,
unreachable, back; the breaker open) are records of Python's standard ``logging``, the
one engines show (SGLang its root logger's handlers, vLLM its ``vllm`` logger's), not
structlog lines, which no engine shows."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tierd.client import Client, Unreachable
from tierd.integrations.core.link import DaemonLink, LinkSettings
from tierd.testing import daemon_config

BLOCK = 4096
DEADLINE_S = 5.0


async def health(client: Client) -> Any:
    return await client.health()


def said(caplog: pytest.LogCaptureFixture, logger: str) -> list[tuple[str, str]]:
    """(level, event) of each record of ``logger``: the event is the text before ':'."""
    return [(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records if r.name == logger]


async def test_the_daemon_lost_and_the_breaker_open_are_standard_logging_records(
    tmp_path: Path, spawn: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    daemon = await spawn(daemon_config(tmp_path, block_bytes=BLOCK))
    settings = LinkSettings(daemon.socket_path, "logs", BLOCK, breaker_failures=1)
    link = DaemonLink(settings, name="tierd-test-logs", map_pool=False)
    try:
        await asyncio.to_thread(link.ask, health, time.monotonic() + DEADLINE_S)  # connected
        assert said(caplog, "tierd.integrations.core.link") == []
        daemon.signal(signal.SIGKILL)
        await daemon.wait()
        with pytest.raises(Unreachable):
            await asyncio.to_thread(link.ask, health, time.monotonic() + DEADLINE_S)
        lines = said(caplog, "tierd.integrations.core.link")
        assert ("WARNING", "tierd daemon lost") in lines, lines
        assert ("WARNING", "tierd breaker open") in lines, lines
        lost = next(r for r in caplog.records if r.getMessage().startswith("tierd daemon lost"))
        assert f"socket={daemon.socket_path}" in lost.getMessage()  # its fields, as text
    finally:
        link.close()


async def test_a_standard_logger_the_engine_hands_over_gets_the_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As vLLM's tier would hand its ``vllm.tierd`` (vLLM's handler, format and level;
    another name here: vLLM's own logger does not propagate to caplog's root handler)."""
    caplog.set_level(logging.INFO)
    nobody = str(tmp_path / "nobody.sock")  # no daemon ever listens here
    settings = LinkSettings(nobody, "logs", BLOCK, breaker_failures=1)
    engine_log = logging.getLogger("an_engine.tierd")
    link = DaemonLink(settings, name="tierd-test-logs", logger=engine_log, map_pool=False)
    try:
        with pytest.raises(Unreachable):
            await asyncio.to_thread(link.ask, health, time.monotonic() + DEADLINE_S)
        lines = said(caplog, "an_engine.tierd")
        assert ("WARNING", "tierd daemon unreachable") in lines, lines
        assert ("WARNING", "tierd breaker open") in lines, lines
        assert said(caplog, "tierd.integrations.core.link") == []
    finally:
        link.close()
