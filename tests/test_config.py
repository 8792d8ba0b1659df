"""The daemon's configuration: the models' validation, the precedence of defaults < file <
``TIERD_*`` environment < ``--set``, ``tierd config check|show``, and the shipped files."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml

from tierd.cli import main
from tierd.config import (
    ChainConfig,
    DaemonConfig,
    NamespaceConfig,
    default_socket_path,
    load_config,
    parse_mode,
    parse_seconds,
)
from tierd.errors import ConfigError
from tierd.settings import effective_config_dict, load_settings, parse_sets
from tierd.share import shipped

ROOT = Path(__file__).resolve().parent.parent
TWO_TIERS = """\
block_bytes: 256KiB
tiers:
  - {name: cpu, kind: cpu, capacity: 1GiB}
  - {name: disk, kind: disk, capacity: 8GiB, directories: [/tmp/tierd-test-disk]}
socket:
  path: /from/file.sock
"""


def write(tmp_path: Path, text: str = TWO_TIERS, name: str = "tierd.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(data: dict[str, Any] | None = None, *, sets: Sequence[str] = ()) -> str:
    """The ConfigError text for the mapping ``data``, or for defaults plus ``sets``."""
    load = functools.partial(load_settings, None, environ={}, sets=sets)
    if data is not None:
        load = functools.partial(load_config, data, DaemonConfig)
    with pytest.raises(ConfigError) as caught:
        load()
    return str(caught.value)


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    """``tierd.cli.main`` points structlog at the current (captured) stderr; put the
    previous configuration back so later tests do not log to a closed capture file."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture
def clean_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """For the command line, which reads ``os.environ``: no TIERD_* config variables."""
    for name in list(os.environ):
        if name.startswith("TIERD_") and name != "TIERD_HYPOTHESIS_PROFILE":
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))


# -- the models -------------------------------------------------------------------------


def test_defaults_validate() -> None:
    cfg = DaemonConfig()
    assert [(t.name, t.kind, t.capacity, t.policy) for t in cfg.tiers] == [
        ("cpu", "cpu", "1GiB", "lru")
    ]
    assert cfg.block_bytes == ChainConfig.model_fields["block_bytes"].default
    assert cfg.socket.mode == 0o600
    assert (cfg.socket.allow_uids, cfg.socket.allow_gids) == ([], [])
    assert cfg.limits.max_frame_bytes == 64 << 20
    assert (cfg.limits.max_keys_per_request, cfg.limits.max_connections) == (4096, 1024)
    assert (cfg.logging.level, cfg.logging.format) == ("info", "auto")
    assert (cfg.metrics.http_port, cfg.metrics.http_host) == (None, "127.0.0.1")
    assert (cfg.shutdown.grace, cfg.shutdown.write_back) == (10.0, "flush")
    assert cfg.events.queue_batches == 1024
    no_xdg = DaemonConfig(socket={"path": default_socket_path({})})
    assert load_settings(None, environ={}) == no_xdg


def test_default_socket_path() -> None:
    runtime = Path("/run/user/7/tierd/tierd.sock")
    assert default_socket_path({"XDG_RUNTIME_DIR": "/run/user/7"}) == runtime
    assert default_socket_path({}) == Path(f"/tmp/tierd-{os.getuid()}/tierd.sock")
    assert default_socket_path({"XDG_RUNTIME_DIR": ""}) == Path(
        f"/tmp/tierd-{os.getuid()}/tierd.sock"
    )
    cfg = load_settings(None, environ={"XDG_RUNTIME_DIR": "/run/user/7"})
    assert cfg.socket.path == Path("/run/user/7/tierd/tierd.sock")


@pytest.mark.parametrize(
    ("value", "mode"),
    [
        (0o640, 0o640),
        (384, 0o600),
        ("0600", 0o600),
        ("0o660", 0o660),
        ("600", 0o600),
        (0o777, 0o777),
    ],
)
def test_parse_mode(value: object, mode: int) -> None:
    assert parse_mode(value) == mode


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("rw", "not an octal mode"),
        ("0o8", "not an octal mode"),
        (600, "within 0..0o777"),
        (-1, "within 0..0o777"),
        (True, "octal number"),
        ("0o400", "mode must include owner read/write (0o600)"),
        (0o066, "mode must include owner read/write (0o600)"),
    ],
)
def test_socket_mode_errors_name_the_path(value: object, message: str) -> None:
    text = problems({"socket": {"mode": value}})
    assert text.startswith("socket.mode: ")
    assert message in text


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(10, 10.0), (2.5, 2.5), ("10s", 10.0), ("500ms", 0.5), ("2m", 120.0), ("3", 3.0)],
)
def test_grace_parses_durations(value: object, seconds: float) -> None:
    assert parse_seconds(value) == seconds
    assert DaemonConfig(shutdown={"grace": value}).shutdown.grace == seconds


@pytest.mark.parametrize("value", ["10x", "soon", 0, -1, "0s", True, None, "nan"])
def test_grace_rejects(value: object) -> None:
    assert problems({"shutdown": {"grace": value}}).startswith("shutdown.grace: ")


def test_max_frame_bytes_must_fit_an_inline_block() -> None:
    text = problems({"block_bytes": "1MiB", "limits": {"max_frame_bytes": "1MiB"}})
    assert text.startswith("limits.max_frame_bytes: ")
    assert str((1 << 20) + (64 << 10)) in text
    fits = DaemonConfig(block_bytes="1MiB", limits={"max_frame_bytes": (1 << 20) + (64 << 10)})
    assert fits.limits.max_frame_bytes == (1 << 20) + (64 << 10)
    assert problems({"limits": {"max_frame_bytes": 1024}}).startswith("limits.max_frame_bytes: ")


@pytest.mark.parametrize(
    ("section", "data", "path"),
    [
        ("limits", {"max_keys_per_request": 0}, "limits.max_keys_per_request"),
        ("limits", {"max_connections": 0}, "limits.max_connections"),
        ("metrics", {"http_port": 70000}, "metrics.http_port"),
        ("logging", {"level": "loud"}, "logging.level"),
        ("logging", {"format": "xml"}, "logging.format"),
        ("shutdown", {"write_back": "later"}, "shutdown.write_back"),
        ("events", {"queue_batches": 0}, "events.queue_batches"),
        ("socket", {"allow_gids": ["staff"]}, "socket.allow_gids.0"),
    ],
)
def test_section_values_are_checked(section: str, data: dict[str, Any], path: str) -> None:
    assert problems({section: data}).startswith(f"{path}: ")


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.1", "::", "example.com"])
def test_metrics_host_must_be_loopback(host: str) -> None:
    text = problems({"metrics": {"http_host": host, "http_port": 9464}})
    assert text.startswith("metrics.http_host: ")
    assert "loopback" in text


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "localhost"])
def test_metrics_loopback_hosts(host: str) -> None:
    assert DaemonConfig(metrics={"http_host": host}).metrics.http_host == host


def test_namespaces() -> None:
    assert problems({"namespaces": {"pattern": "(["}}).startswith("namespaces.pattern: ")
    text = problems({"namespaces": {"allowed": ["good", "has space"]}})
    assert text.startswith("namespaces.allowed.1: 'has space' does not match")
    spaces = NamespaceConfig()
    assert spaces.check("llama-3/70b@v1") is None
    assert "does not match" in (spaces.check("") or "")
    assert "does not match" in (spaces.check("x" * 129) or "")
    assert "does not match" in (spaces.check("ok\n") or "")  # the whole name must match
    listed = NamespaceConfig(allowed=["a", "b"])
    assert listed.check("a") is None
    assert "not allowed (allowed: a, b)" in (listed.check("c") or "")


@pytest.mark.parametrize(
    "data",
    [
        {"socket": {"pth": "/x"}},
        {"limits": {"max_frames": 1}},
        {"metrics": {"port": 1}},
        {"shutdown": {"timeout": 1}},
        {"sockets": {}},
    ],
)
def test_unknown_keys_are_named(data: dict[str, Any]) -> None:
    section, inner = next(iter(data.items()))
    path = ".".join([section, *inner]) if inner else section
    assert problems(data).startswith(f"{path}: not a setting")


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({"socket": {"pth": "/x"}}, "socket.pth: not a setting; did you mean socket.path?"),
        ({"sockets": {}}, "sockets: not a setting; did you mean socket?"),
        ({"blok_bytes": 4096}, "blok_bytes: not a setting; did you mean block_bytes?"),
        (
            {"tiers": [{"name": "m", "kind": "memory", "capacity": 4, "polcy": "lru"}]},
            "tiers.0.polcy: not a setting; did you mean tiers.0.policy?",
        ),
        ({"shutdown": {"zzz": 1}}, "shutdown.zzz: not a setting"),
    ],
)
def test_a_misspelt_key_suggests_the_setting(data: dict[str, Any], problem: str) -> None:
    assert problems(data) == problem


def test_a_misspelt_set_suggests_the_setting() -> None:
    assert problems(sets=["tiers.0.capacty=4"]) == (
        "tiers.0.capacty (from --set): not a setting; did you mean tiers.0.capacity?"
    )


@pytest.mark.parametrize(
    ("variable", "problem"),
    [
        ("TIERD_BLOK_BYTES", "TIERD_BLOK_BYTES: not a setting; did you mean TIERD_BLOCK_BYTES?"),
        ("TIERD_SOCKT__PATH", "TIERD_SOCKT__PATH: not a setting; did you mean TIERD_SOCKET?"),
        ("TIERD_CONFG", "TIERD_CONFG: not a setting; did you mean TIERD_CONFIG?"),
        (
            "TIERD_LOGGING__LEVL",
            "logging.levl (from TIERD_LOGGING__LEVL): not a setting; did you mean logging.level?",
        ),
    ],
)
def test_a_misspelt_variable_suggests_the_setting(
    tmp_path: Path, variable: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path), environ={variable: "1"})
    assert str(caught.value) == problem


def test_disk_directories_expand_home_and_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DRIVE", "/mnt/nvme0")
    monkeypatch.delenv("UNSET_STATE", raising=False)
    dirs = ["~/a", "$DRIVE/b", "${DRIVE}/c", "${UNSET_STATE:-~/state}/d", "${DRIVE:-/x}/e"]
    tiers = [{"name": "d", "kind": "disk", "capacity": 8, "directories": dirs}]
    cfg = load_config({"tiers": tiers}, ChainConfig)
    assert [str(d) for d in cfg.tiers[0].directories] == [
        f"{tmp_path}/a",
        "/mnt/nvme0/b",
        "/mnt/nvme0/c",
        f"{tmp_path}/state/d",
        "/mnt/nvme0/e",
    ]
    tiers[0]["directories"] = ["$UNSET_STATE/d"]
    assert problems({"tiers": tiers}) == (
        "tiers.0.directories: $UNSET_STATE is not set (write ${UNSET_STATE:-DEFAULT} to give a"
        " default)"
    )


def test_chain_errors_name_their_paths() -> None:
    tiers = [{"name": "cpu", "kind": "cpu", "capacity": "1KiB"}]
    assert problems({"tiers": tiers}).startswith("tiers.0.capacity: '1KiB' holds no block")
    assert problems({"entry": "gpu"}).startswith("entry: 'gpu' is not a tier name")
    disk = [{"name": "d", "kind": "disk", "capacity": 8}]
    assert problems({"tiers": disk}).startswith("tiers.0.directories: ")
    gpu = [{"name": "g", "kind": "gpu", "capacity": 8}]
    assert problems({"tiers": gpu}).startswith("tiers.0.device: ")
    twice = [{"name": "a", "kind": "memory", "capacity": 8}] * 2
    assert problems({"tiers": twice}).startswith("tiers: tier names must be unique")


def test_a_daemon_file_still_opens_as_a_chain(tmp_path: Path) -> None:
    path = write(tmp_path, TWO_TIERS + "shutdown: {grace: 5s}\n")
    cfg = load_config(path, ChainConfig)
    assert isinstance(cfg, DaemonConfig)
    assert cfg.shutdown.grace == 5.0
    with pytest.raises(ConfigError, match=r"socket\.pth: not a setting; did you mean socket\.path"):
        load_config(write(tmp_path, TWO_TIERS + "  pth: /x\n"), ChainConfig)
    plain = load_config({"tiers": [{"name": "m", "kind": "memory", "capacity": 4}]}, ChainConfig)
    assert type(plain) is ChainConfig


# -- precedence ---------------------------------------------------------------------------


def test_file_beats_defaults(tmp_path: Path) -> None:
    cfg = load_settings(write(tmp_path), environ={})
    assert cfg.socket.path == Path("/from/file.sock")
    assert cfg.block_bytes == 256 << 10
    assert [t.name for t in cfg.tiers] == ["cpu", "disk"]  # a list replaces the default
    assert cfg.shutdown.grace == 10.0  # untouched sections keep their defaults


def test_env_beats_file_and_set_beats_env(tmp_path: Path) -> None:
    path = write(tmp_path)
    env = {"TIERD_SOCKET__PATH": "/from/env.sock"}
    assert load_settings(path, environ=env).socket.path == Path("/from/env.sock")
    cfg = load_settings(path, environ=env, sets=["socket.path=/from/set.sock"])
    assert cfg.socket.path == Path("/from/set.sock")
    cfg = load_settings(path, environ={}, sets=["socket.path=/from/set.sock"])
    assert cfg.socket.path == Path("/from/set.sock")
    later = ["socket.path=/first.sock", "socket.path=/second.sock"]
    assert load_settings(path, environ={}, sets=later).socket.path == Path("/second.sock")


def test_env_paths(tmp_path: Path) -> None:
    env = {
        "TIERD_BLOCK_BYTES": "1MiB",
        "TIERD_TIERS__0__CAPACITY": "2GiB",
        "TIERD_SHUTDOWN__GRACE": "3",
        "TIERD_SOCKET__MODE": "0o660",
        "TIERD_SOCKET__ALLOW_GIDS": "[10, 20]",
        "TIERD_LOGGING__LEVEL": "debug",
        "TIERD_METRICS__HTTP_PORT": "9464",
    }
    cfg = load_settings(write(tmp_path), environ=env)
    assert cfg.block_bytes == 1 << 20
    assert cfg.tiers[0].capacity == "2GiB"
    assert cfg.tiers[0].num_blocks(cfg.block_bytes) == 2048
    assert cfg.shutdown.grace == 3.0
    assert cfg.socket.mode == 0o660
    assert cfg.socket.allow_gids == [10, 20]
    assert cfg.logging.level == "debug"
    assert cfg.metrics.http_port == 9464


def test_set_values_are_yaml(tmp_path: Path) -> None:
    sets = [
        "tiers.1.capacity=16GiB",
        "tiers.cpu.write_through=true",  # a tier by name
        "socket.mode=0o640",
        "socket.allow_uids=[1000, 1001]",
        "namespaces.pattern=[a-z]+",  # not valid YAML: the plain string
        "shutdown.grace=500ms",
        "metrics={http_port: 9100}",  # a mapping merges into the section
        "entry=disk",
    ]
    cfg = load_settings(write(tmp_path), environ={}, sets=sets)
    assert cfg.tiers[1].capacity == "16GiB"
    assert cfg.tiers[0].write_through is True
    assert cfg.socket.mode == 0o640
    assert cfg.socket.allow_uids == [1000, 1001]
    assert cfg.namespaces.pattern == "[a-z]+"
    assert cfg.shutdown.grace == 0.5
    assert (cfg.metrics.http_port, cfg.metrics.http_host) == (9100, "127.0.0.1")
    assert cfg.entry == "disk"
    assert cfg.socket.path == Path("/from/file.sock")


def test_set_index_into_the_default_tiers() -> None:
    cfg = load_settings(None, environ={}, sets=["tiers.0.capacity=2GiB"])
    assert cfg.tiers[0].capacity == "2GiB"
    assert cfg.tiers[0].name == "cpu"


@pytest.mark.parametrize("item", ["socket.path", "=3", "a..b=1", ".x=1"])
def test_bad_set_syntax(item: str) -> None:
    with pytest.raises(ConfigError, match="--set") as caught:
        parse_sets([item])
    assert repr(item) in str(caught.value)
    assert repr(item) in problems(sets=[item])


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("tiers.5.capacity=1", "tiers.5.capacity (from --set): no tier at index 5 (there are 2)"),
        ("tiers.2=x", "tiers.2 (from --set): no tier at index 2 (there are 2)"),
        ("tiers.ssd.capacity=1", "tiers.ssd.capacity (from --set): no tier named 'ssd'"),
        ("socket.0=1", "socket.0 (from --set): socket is not a list"),
        ("block_bytes.x=1", "block_bytes.x (from --set): block_bytes is a value"),
        ("tiers.0.capacity.x=1", "tiers.0.capacity.x (from --set): tiers.0.capacity is a value"),
    ],
)
def test_set_paths_that_go_nowhere(tmp_path: Path, item: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path), environ={}, sets=[item])
    assert message in str(caught.value)


def test_env_index_out_of_range(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path), environ={"TIERD_TIERS__3__POLICY": "arc"})
    assert "tiers.3.policy (from TIERD_TIERS__3__POLICY): no tier at index 3" in str(caught.value)


def test_problems_say_where_the_value_came_from(tmp_path: Path) -> None:
    env = {"TIERD_SHUTDOWN__GRACE": "soon", "TIERD_SOCKET__PAHT": "/x"}
    sets = ["socket.mode=0o400", "limits.max_frame_bytes=4096", "metrics.http_host=0.0.0.0"]
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, TWO_TIERS + "  mode: 7\n"), environ=env, sets=sets)
    lines = str(caught.value).splitlines()
    assert any(line.startswith("socket.mode (from --set): mode must include") for line in lines)
    assert any(line.startswith("shutdown.grace (from TIERD_SHUTDOWN__GRACE): ") for line in lines)
    assert any(
        line == "socket.paht (from TIERD_SOCKET__PAHT): not a setting; did you mean socket.path?"
        for line in lines
    )
    assert any(line.startswith("metrics.http_host (from --set): ") for line in lines)


def test_a_file_problem_has_no_origin(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, TWO_TIERS + "  mode: 0o400\n"), environ={})
    assert str(caught.value).startswith("socket.mode: mode must include owner read/write")


@pytest.mark.parametrize(
    "name", ["TIERD_HYPOTHESIS_PROFILE", "TIERD_SOCKET", "TIERD_SLOW", "TIERD_", "TIERD_LOGGING"]
)
def test_unrelated_tierd_variables_are_ignored(tmp_path: Path, name: str) -> None:
    env = {name: "/some/path", "TIERD_CONFIG": str(tmp_path / "absent.yaml")}
    cfg = load_settings(write(tmp_path), environ=env)
    assert cfg == load_settings(write(tmp_path), environ={})


def test_tierd_config_names_the_file_when_none_is_given(tmp_path: Path) -> None:
    path = write(tmp_path)
    cfg = load_settings(None, environ={"TIERD_CONFIG": str(path)})
    assert cfg.socket.path == Path("/from/file.sock")
    explicit = write(tmp_path, "socket: {path: /explicit.sock}\n", name="other.yaml")
    cfg = load_settings(explicit, environ={"TIERD_CONFIG": str(path)})
    assert cfg.socket.path == Path("/explicit.sock")
    with pytest.raises(ConfigError, match=r"absent\.yaml: cannot read config file"):
        load_settings(None, environ={"TIERD_CONFIG": str(tmp_path / "absent.yaml")})


def test_file_problems_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"absent\.yaml: cannot read config file"):
        load_settings(tmp_path / "absent.yaml", environ={})
    with pytest.raises(ConfigError, match=r"list\.yaml: the config must be a mapping"):
        load_settings(write(tmp_path, "- a\n", name="list.yaml"), environ={})
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML"):
        load_settings(write(tmp_path, "a: [\n", name="bad.yaml"), environ={})
    twice = "tiers:\n  - name: cpu\n    kind: cpu\n    capacity: 8\n    capacity: 16\n"
    with pytest.raises(ConfigError, match=r"'capacity' is given twice \(lines 4 and 5\)"):
        load_settings(write(tmp_path, twice, name="twice.yaml"), environ={})
    with pytest.raises(ConfigError, match=r"'level' is given twice \(lines 1 and 1\)"):
        load_settings(write(tmp_path, "logging: {level: info, level: debug}\n"), environ={})
    empty = load_settings(write(tmp_path, "# all defaults\n", name="empty.yaml"), environ={})
    assert empty.tiers == DaemonConfig().tiers


def test_effective_config_round_trips(tmp_path: Path) -> None:
    cfg = load_settings(write(tmp_path), environ={}, sets=["socket.mode=0o640"])
    data = effective_config_dict(cfg)
    assert data["socket"] == {
        "path": "/from/file.sock",
        "pid_file": None,
        "mode": "0o640",
        "allow_uids": [],
        "allow_gids": [],
    }
    assert json.loads(json.dumps(data)) == data
    shown = write(tmp_path, yaml.safe_dump(data), name="shown.yaml")
    assert load_settings(shown, environ={}) == cfg


# -- the command line -----------------------------------------------------------------------


@pytest.mark.usefixtures("clean_environ")
def test_cli_check_a_good_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `config check` compares a disk tier with its file system's free space, so the
    # file's disk tier is small and lives in the test's own directory: the check must
    # not depend on how full the machine's /tmp happens to be.
    disk = tmp_path / "disk"
    text = TWO_TIERS.replace("capacity: 8GiB", "capacity: 256MiB")
    path = write(tmp_path, text.replace("/tmp/tierd-test-disk", str(disk)))
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert out == (
        f"ok: {path} (2 tiers: cpu 4096 blocks lru, disk 1024 blocks lru; "
        "block 256KiB; socket /from/file.sock)\n"
    )
    assert main(["config", "check", str(path), "--set", "tiers.0.policy=arc"]) == 0
    assert "cpu 4096 blocks arc" in capsys.readouterr().out


@pytest.mark.usefixtures("clean_environ")
def test_cli_check_a_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = TWO_TIERS + "  mode: rw\nmetrics: {http_host: 0.0.0.0}\n"
    path = write(tmp_path, bad)
    assert main(["config", "check", str(path), "--set", "shutdown.grace=-1"]) == 78
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert lines[0] == "tierd: error: invalid configuration:"
    assert lines[1].startswith("socket.mode: ")
    assert any(line.startswith("metrics.http_host: ") for line in lines)
    assert any(line.startswith("shutdown.grace (from --set): ") for line in lines)


@pytest.mark.usefixtures("clean_environ")
def test_cli_check_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.yaml"
    assert main(["config", "check", str(missing)]) == 78
    assert f"{missing}: cannot read config file" in capsys.readouterr().err
    assert main(["config", "check", str(write(tmp_path)), "--set", "oops"]) == 78
    assert "--set 'oops': expected PATH=VALUE" in capsys.readouterr().err


@pytest.mark.usefixtures("clean_environ")
def test_cli_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path)
    assert main(["config", "show", "-c", str(path), "--set", "socket.mode=0o660", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["socket"]["mode"] == "0o660"
    assert data["socket"]["path"] == "/from/file.sock"
    assert [tier["name"] for tier in data["tiers"]] == ["cpu", "disk"]
    # No -c and no daemon answering: what `tierd serve` would run, the shipped config.
    assert main(["config", "show"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    own = tmp_path / "tierd" / "tierd.sock"
    assert shown["socket"]["path"] == str(own)  # from XDG_RUNTIME_DIR
    assert shown == effective_config_dict(load_settings(shipped("tierd.yaml")))


def test_cli_show_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TIERD_CONFIG", str(write(tmp_path)))
    monkeypatch.setenv("TIERD_SHUTDOWN__GRACE", "2m")
    monkeypatch.setenv("TIERD_SOCKET", "/some/client/override.sock")
    assert main(["config", "show", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["shutdown"]["grace"] == 120.0
    assert data["socket"]["path"] == "/from/file.sock"


# -- the shipped files ------------------------------------------------------------------


def test_shipped_default_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    cfg = load_settings(ROOT / "config" / "tierd.yaml", environ={})
    assert [(t.name, t.kind) for t in cfg.tiers] == [("cpu", "cpu"), ("disk", "disk")]
    # A first run fits a laptop: a small disk tier in the XDG state directory.
    assert cfg.tiers[1].directories == [tmp_path / ".local" / "state" / "tierd" / "disk"]
    assert cfg.tiers[1].num_blocks(cfg.block_bytes) * cfg.block_bytes == 2 << 30
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    cfg = load_settings(ROOT / "config" / "tierd.yaml", environ={})
    assert cfg.tiers[1].directories == [tmp_path / "state" / "tierd" / "disk"]
    assert cfg.block_bytes == 256 << 10
    assert cfg.entry == "cpu"
    assert cfg.socket.path == Path(f"/tmp/tierd-{os.getuid()}/tierd.sock")  # the default
    assert cfg.shutdown.write_back == "flush"


def test_shipped_gpu_node_config() -> None:
    cfg = load_settings(ROOT / "config" / "gpu-node.yaml", environ={})
    # No GPU tier: the engines own GPU memory, and socket clients never fill a daemon's.
    assert [t.kind for t in cfg.tiers] == ["cpu", "disk"]
    assert len(cfg.tiers[1].directories) == 2
    assert cfg.entry == "cpu"
    assert cfg.socket.path == Path("/run/tierd/tierd.sock")
    assert cfg.socket.mode == 0o660
    assert cfg.socket.allow_gids
