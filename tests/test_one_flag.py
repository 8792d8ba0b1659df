"""tierd under an engine in one line (issue 39, item 2).

- ``tierd engine-config vllm|sglang`` against real ``tierd serve`` processes: the flags
  name the socket the daemon serves (found as client commands find it) and say its block
  size; with no daemon they are printed all the same, with a warning naming the path.
- The paste-ready examples of docs/vllm.md and docs/sglang.md parse, name no socket the
  daemon never uses, and are the configs ``engine-config`` prints.
- ``TIERD``: what it means, and what vLLM's plugin does with it (nothing when unset).
- An engine whose daemon is missing at start-up says so once, at WARNING, through the
  engine's own logging, with the path it tried and how to start the daemon.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from daemon_kit import child_env

from tierd.control.socketfile import default_socket_path
from tierd.integrations.core.one_flag import (
    Switch,
    SwitchInvalid,
    read_switch,
    sglang_extra_config,
    vllm_pool_config,
    vllm_transfer_config,
)
from tierd.testing import daemon_config

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 32768
OLD_SOCKET = "/run/user/1000/tierd.sock"  # what the docs used to paste: no daemon's path


async def engine_config(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tierd", "engine-config", *argv]
    return await asyncio.to_thread(
        subprocess.run,
        command,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def pasted_json(line: str, flag: str) -> Any:
    """The JSON argument of ``flag`` in a pasted shell line."""
    words = shlex.split(line.rstrip("\\"))
    return json.loads(words[words.index(flag) + 1])


# -- tierd engine-config ------------------------------------------------------------------


async def test_engine_config_vllm_names_the_daemons_socket_and_block_size(
    tmp_path: Path, spawn: Any
) -> None:
    daemon = await spawn(daemon_config(tmp_path, block_bytes=BLOCK))
    sock = daemon.socket_path
    done = await engine_config("vllm", "--socket", sock, "--model", "/models/my llama")
    assert done.returncode == 0, done.stderr
    assert f"the daemon at {sock} answers; its block_bytes is {BLOCK}" in done.stderr
    pool_title, pool_line, second_title, second_line, comment, switch = done.stdout.splitlines()
    assert "pool as vLLM's CPU tier" in pool_title and "secondary" in second_title
    assert shlex.split(pool_line)[:3] == ["vllm", "serve", "/models/my llama"]
    assert pasted_json(pool_line, "--kv-transfer-config") == vllm_pool_config(sock)
    config = pasted_json(second_line, "--kv-transfer-config")
    assert config == vllm_transfer_config(sock)
    assert config["kv_connector_extra_config"]["secondary_tiers"][0]["socket"] == sock
    assert comment.startswith("#") and "TIERD_VLLM_MODE" in comment
    assert shlex.split(switch) == [f"TIERD={sock}", "vllm", "serve", "/models/my llama"]

    as_json = await engine_config("vllm", "--socket", sock, "--json", "--namespace", "team-a")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == vllm_pool_config(sock, namespace="team-a")
    second = await engine_config("vllm", "--socket", sock, "--json", "--mode", "secondary")
    assert json.loads(second.stdout) == vllm_transfer_config(sock)
    cpu = await engine_config(
        "vllm", "--socket", sock, "--json", "--mode", "secondary", "--cpu-build"
    )
    assert json.loads(cpu.stdout) == vllm_transfer_config(sock, cpu_build=True)
    one = await engine_config("vllm", "--socket", sock, "--mode", "secondary")
    assert shlex.split(one.stdout.splitlines()[-1])[:2] == [
        "TIERD_VLLM_MODE=secondary",
        f"TIERD={sock}",
    ]


async def test_engine_config_says_nothing_is_to_set_for_a_daemon_of_several_sizes(
    tmp_path: Path, spawn: Any
) -> None:
    daemon = await spawn(daemon_config(tmp_path, block_bytes=BLOCK, block_sizes=3))
    done = await engine_config("sglang", "--socket", daemon.socket_path)
    assert done.returncode == 0, done.stderr
    assert "serves up to 3 block sizes (block_sizes)" in done.stderr
    assert "nothing to set" in done.stderr and "must be that size" not in done.stderr


async def test_engine_config_finds_the_socket_as_client_commands_do(
    tmp_path: Path, spawn: Any
) -> None:
    daemon = await spawn(daemon_config(tmp_path, block_bytes=BLOCK))
    done = await engine_config("sglang", "--json", TIERD_SOCKET=daemon.socket_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == sglang_extra_config(daemon.socket_path)
    assert "one page of SGLang's host pool must be that size" in done.stderr

    plain = await engine_config("sglang", TIERD_SOCKET=daemon.socket_path)
    assert plain.returncode == 0, plain.stderr
    last = plain.stdout.splitlines()[-1]
    assert pasted_json(last, "--hicache-storage-backend-extra-config") == sglang_extra_config(
        daemon.socket_path
    )


async def test_engine_config_without_a_daemon_warns_with_the_path_and_prints_the_flags(
    tmp_path: Path,
) -> None:
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    expected = str(default_socket_path({"XDG_RUNTIME_DIR": str(runtime)}))
    done = await engine_config("vllm", XDG_RUNTIME_DIR=str(runtime))
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("warning") == 1
    assert f"cannot reach the daemon at {expected}" in done.stderr
    assert "`tierd serve`" in done.stderr
    lines = done.stdout.splitlines()
    assert pasted_json(lines[1], "--kv-transfer-config") == vllm_pool_config(expected)
    config = pasted_json(lines[3], "--kv-transfer-config")
    assert config["kv_connector_extra_config"]["secondary_tiers"][0]["socket"] == expected
    assert lines[-1] == "TIERD=1 vllm serve MODEL"  # the default path: TIERD=1 finds it


# -- the docs' examples -------------------------------------------------------------------


def doc_examples(name: str) -> list[Any]:
    """Every single-quoted JSON object in the bash blocks of ``docs/<name>``."""
    text = (ROOT / "docs" / name).read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    found = [json.loads(m) for block in blocks for m in re.findall(r"'(\{.*?\})'", block, re.S)]
    assert found, f"no JSON example in docs/{name}"
    return found


def sockets_named(value: Any) -> list[str]:
    if isinstance(value, dict):
        own = [value["socket"]] if "socket" in value else []
        return own + [s for v in value.values() for s in sockets_named(v)]
    if isinstance(value, list):
        return [s for v in value for s in sockets_named(v)]
    return []


def test_docs_examples_parse_and_are_what_engine_config_prints() -> None:
    pool, vllm = doc_examples("vllm.md")  # tierd's pool as vLLM's CPU tier, then behind it
    (sglang,) = doc_examples("sglang.md")
    # No socket (the integrations then use the daemon's own default path, for any user),
    # or the default path of the user the example is written for.
    default = str(default_socket_path({"XDG_RUNTIME_DIR": "/run/user/1000"}))
    for example in (pool, vllm, sglang):
        assert set(sockets_named(example)) <= {default}, example
    assert pool == vllm_pool_config(default)
    printed = vllm_transfer_config(default)
    if "socket" not in vllm["kv_connector_extra_config"]["secondary_tiers"][0]:
        del printed["kv_connector_extra_config"]["secondary_tiers"][0]["socket"]
    assert vllm == printed
    printed = sglang_extra_config(default)
    if "socket" not in sglang:
        del printed["socket"]
    assert sglang == printed


def test_no_example_names_the_socket_no_daemon_uses() -> None:
    paths = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "tierd").rglob("*.py")]
    offenders = [str(p.relative_to(ROOT)) for p in paths if OLD_SOCKET in p.read_text()]
    assert offenders == []


# -- TIERD ----------------------------------------------------------------------------------


def test_tierd_switch_values() -> None:
    env = {"XDG_RUNTIME_DIR": "/run/user/7"}
    for off in ("", "0", "off", "False", "no", " "):
        assert read_switch({**env, "TIERD": off}) is None
    assert read_switch(env) is None
    assert read_switch({**env, "TIERD": "1"}) == Switch(
        "/run/user/7/tierd/tierd.sock", "the default path"
    )
    assert read_switch({**env, "TIERD": "on", "TIERD_SOCKET": "/s/t.sock"}) == Switch(
        "/s/t.sock", "TIERD_SOCKET"
    )
    assert read_switch({**env, "TIERD": "/srv/tierd.sock"}) == Switch("/srv/tierd.sock", "TIERD")
    with pytest.raises(SwitchInvalid, match=r"TIERD='maybe': expected 1 .* absolute path"):
        read_switch({"TIERD": "maybe"})


@pytest.fixture
def engine_args_class(monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's EngineArgs, its create_engine_config restored after the test."""
    arg_utils = pytest.importorskip(
        "vllm.engine.arg_utils", reason="vLLM is not installed: run scripts/setup_vllm"
    )
    cls = arg_utils.EngineArgs
    monkeypatch.setattr(cls, "create_engine_config", cls.create_engine_config)
    monkeypatch.delenv("TIERD", raising=False)
    return cls


def test_vllm_plugin_changes_nothing_without_tierd(engine_args_class: Any) -> None:
    from types import SimpleNamespace

    from tierd.integrations.vllm import plugin as vllm_plugin

    before = engine_args_class.create_engine_config
    vllm_plugin.register()
    assert engine_args_class.create_engine_config is before
    args = SimpleNamespace(kv_transfer_config=None, kv_offloading_size=None)
    assert vllm_plugin.fill_in(args) is False
    assert args.kv_transfer_config is None


def test_vllm_plugin_fills_in_the_config_only_when_none_was_given(
    engine_args_class: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.platforms import current_platform

    from tierd.integrations.vllm import plugin as vllm_plugin

    monkeypatch.setenv("TIERD", "/srv/tierd/tierd.sock")
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM loads plugins in several places: wrapped once
    wrapped = engine_args_class.create_engine_config
    assert getattr(wrapped, "_tierd_wrapped", False)
    assert getattr(wrapped.__wrapped__, "_tierd_wrapped", False) is False

    args = SimpleNamespace(kv_transfer_config=None, kv_offloading_size=None)
    assert vllm_plugin.fill_in(args) is True
    expected = vllm_transfer_config("/srv/tierd/tierd.sock", cpu_build=current_platform.is_cpu())
    filled = args.kv_transfer_config
    assert isinstance(filled, KVTransferConfig)
    assert (filled.kv_connector, filled.kv_role) == ("TierdConnector", "kv_both")
    assert filled.kv_connector_module_path == "tierd.integrations.vllm.connector"
    assert filled.kv_connector_extra_config == expected["kv_connector_extra_config"]

    given = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both")
    mine = SimpleNamespace(kv_transfer_config=given, kv_offloading_size=None)
    assert vllm_plugin.fill_in(mine) is False and mine.kv_transfer_config is given
    other = SimpleNamespace(
        kv_transfer_config=None, kv_offloading_size=8, kv_offloading_backend="lmcache"
    )
    assert vllm_plugin.fill_in(other) is False and other.kv_transfer_config is None

    monkeypatch.setenv("TIERD", "perhaps")
    with pytest.raises(SwitchInvalid, match="TIERD='perhaps'"):
        vllm_plugin.fill_in(SimpleNamespace(kv_transfer_config=None))


# SGLang's own plugin loader, argument parser and resolution, as its launcher runs them;
# prints the HiCache fields. (The torchvision ops: as tests/sglang_kit/driver.py says.)
SGLANG_ARGS = """
import json, torch
ops = torch.library.Library("torchvision", "DEF")
ops.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
ops.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args
load_plugins()
args = prepare_server_args(["--model-path", "dummy"])
args.resolve_once()
names = ("enable_hierarchical_cache", "hicache_storage_backend",
         "hicache_storage_backend_extra_config")
print(json.dumps({name: getattr(args, name) for name in names}))
"""


async def sglang_server_args(**env: str) -> dict[str, Any]:
    from sglang_kit.engines import SGLANG_PYTHON

    done = await asyncio.to_thread(
        subprocess.run,
        [str(SGLANG_PYTHON), "-c", SGLANG_ARGS],
        env=child_env(PYTHONPATH=str(ROOT), **env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.splitlines()[-1]))


async def test_sglang_with_tierd_set_gets_tierds_hicache_flags_and_its_pages(
    tmp_path: Path, spawn: Any
) -> None:
    from sglang_kit.engines import Engines, missing_reason, page_bytes, tierd_spec

    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    daemon = await spawn(daemon_config(tmp_path, block_bytes=page_bytes(), cpu_blocks=64))
    sock = daemon.socket_path
    off, on = await asyncio.gather(sglang_server_args(), sglang_server_args(TIERD=sock))
    assert off == dict.fromkeys(off, None) | {"enable_hierarchical_cache": False}
    extra = on["hicache_storage_backend_extra_config"]
    assert (on["enable_hierarchical_cache"], on["hicache_storage_backend"]) == (True, "dynamic")
    assert json.loads(extra) == sglang_extra_config(sock)

    # The flags SGLang resolved load tierd's backend, which serves one engine's pages to
    # another through the daemon.
    engines = Engines()
    try:
        opened = engines.open("a", tierd_spec(sock, launch_extra=extra))
        assert (opened["backend"], opened["memfd"]) == ("TierdHiCache", True)
        engines.open("b", tierd_spec(sock, launch_extra=extra))
        assert engines.write("a", seed=5, pages=8)["stored_pages"] == 8
        answer = engines.read("b", seed=5, pages=8)
    finally:
        engines.close()
    assert answer["hit_pages"] == answer["loaded_pages"] == answer["identical"] == 8


# -- a missing daemon at start-up -----------------------------------------------------------


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_vllm_without_its_daemon_says_so_once_through_vllms_logger(tmp_path: Path) -> None:
    pytest.importorskip(
        "vllm.v1.kv_offload.tiering.base", reason="vLLM is not installed: run scripts/setup_vllm"
    )
    from vllm_kit import make_tier, primary_rows

    sock = str(tmp_path / "nobody" / "tierd.sock")
    lines = Lines()
    logger = logging.getLogger("vllm.tierd")
    logger.addHandler(lines)
    try:
        tier = make_tier(sock, primary_rows(4))
        tier.shutdown()
    finally:
        logger.removeHandler(lines)
    loud = [r for r in lines.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1, [r.getMessage() for r in lines.records]
    text = loud[0].getMessage()
    assert f"no daemon answers at {sock} (no socket there)" in text
    assert f"tierd serve --set socket.path={sock}" in text
    assert loud[0].name.startswith("vllm.")  # vLLM's handler and format apply


def test_sglang_without_its_daemon_says_so_once_through_sglangs_logging(tmp_path: Path) -> None:
    from sglang_kit.engines import Engines, missing_reason, tierd_spec

    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    sock = str(tmp_path / "nobody" / "tierd.sock")
    engines = Engines()
    try:
        assert engines.open("main", tierd_spec(sock))["ready"] is True
        lines = engines.ask("log")["tierd_logs"]
    finally:
        engines.close()
    loud = [text for level, text in lines if level == "WARNING" and "no daemon answers" in text]
    assert len(loud) == 1, lines
    assert f"no daemon answers at {sock} (no socket there)" in loud[0]
    assert f"tierd serve --set socket.path={sock}" in loud[0]


def test_missing_daemon_message_says_default_start_for_the_default_path() -> None:
    from tierd.integrations.core.one_flag import missing_daemon

    refused = ConnectionRefusedError(111, "Connection refused")
    text = missing_daemon(str(default_socket_path()), refused)
    assert "the socket is there but no daemon listens on it" in text
    assert text.endswith("start it with `tierd serve`")
    assert os.fspath(default_socket_path()) in text


async def test_tierd_picks_the_pool_mode_when_the_daemon_serves_a_pool_and_says_so(
    tmp_path: Path, spawn: Any, engine_args_class: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 58, item 5: ``TIERD=1`` makes tierd's pool vLLM's CPU tier when the daemon
    answers with one, and says so; ``TIERD_VLLM_MODE`` picks either; a daemon that does
    not answer, or one whose entry tier is not a pool, or a ``--kv-offloading-size``
    (vLLM's own CPU tier sized) keeps vLLM's own CPU tier with tierd behind it."""
    from types import SimpleNamespace

    from tierd.integrations.core.one_flag import choose_vllm_mode
    from tierd.integrations.vllm import plugin as vllm_plugin

    daemon = await spawn(daemon_config(tmp_path, block_bytes=BLOCK))
    sock = daemon.socket_path
    monkeypatch.setenv("TIERD", sock)
    assert choose_vllm_mode(sock, {}).name == "pool"
    args = SimpleNamespace(kv_transfer_config=None, kv_offloading_size=None)
    assert vllm_plugin.fill_in(args) is True
    assert (
        args.kv_transfer_config.kv_connector_extra_config
        == (vllm_pool_config(sock)["kv_connector_extra_config"])
    )
    sized = SimpleNamespace(kv_transfer_config=None, kv_offloading_size=8)
    assert vllm_plugin.fill_in(sized) is True
    assert "secondary_tiers" in sized.kv_transfer_config.kv_connector_extra_config
    assert choose_vllm_mode(sock, {"TIERD_VLLM_MODE": "secondary"}).name == "secondary"
    gone = choose_vllm_mode(str(tmp_path / "nobody.sock"), {})
    assert gone.name == "secondary" and "no daemon answers" in gone.why
    with pytest.raises(SwitchInvalid, match="TIERD_VLLM_MODE"):
        choose_vllm_mode(sock, {"TIERD_VLLM_MODE": "both"})
    unpooled = daemon_config(tmp_path, block_bytes=BLOCK, disk_blocks=None)
    unpooled["tiers"] = [{"name": "mem", "kind": "memory", "capacity": 8}]
    other = await spawn(unpooled)
    mode = choose_vllm_mode(other.socket_path, {})
    assert mode.name == "secondary" and "not a shared-memory pool" in mode.why
