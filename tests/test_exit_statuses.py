"""Each exit status the README documents is what the commands return: one case per status
and per kind of cause it names, and the README's list of statuses is exactly the one
tested here (130, Ctrl-C, is shown in ``tests/test_long_runs.py``). The commands run
through ``tierd.cli.main`` in this process, and a daemon's own failure to start (the
status systemd sees) as ``python -m tierd serve`` in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tierd.cli import main
from tierd.testing import short_socket_path
from tierd.workload.generate import GeneratorConfig, generate
from tierd.workload.trace import write_trace

ROOT = Path(__file__).resolve().parent.parent
INTERRUPTED = 130  # tests/test_long_runs.py: test_ctrl_c_during_*


def tierd(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
    return subprocess.run(
        [sys.executable, "-m", "tierd", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A good config, a bad one, a small trace and a directory where a trace should be."""
    home = tmp_path_factory.mktemp("exit")
    cpu = {"name": "cpu", "kind": "cpu", "capacity": 64}
    good = {"block_bytes": 4096, "socket": {"path": short_socket_path()}, "tiers": [cpu]}
    (home / "good.yaml").write_text(yaml.safe_dump(good))
    (home / "bad.yaml").write_text(yaml.safe_dump({**good, "tiers": [cpu, cpu]}))
    write_trace(home / "trace.jsonl", generate(GeneratorConfig(seed=3, conversations=4)))
    (home / "a-directory").mkdir()
    return home


# status -> the commands that must return it, one per cause the README names
CASES: dict[int, list[list[str]]] = {
    0: [["config", "check", "good.yaml"], ["simulate", "trace.jsonl", "--capacity", "8"]],
    1: [["simulate", "a-directory"]],
    2: [
        ["stats", "--bogus"],
        ["simulate", "no-such-trace.jsonl"],
        ["simulate", "trace.jsonl", "--policy", "no-such-policy"],
    ],
    3: [["stats", "--socket", "no-daemon.sock"], ["health", "--socket", "no-daemon.sock"]],
    78: [
        ["config", "check", "bad.yaml"],
        ["config", "check", "no-such.yaml"],
        ["serve", "-c", "bad.yaml"],
        ["stats", "-c", "no-such.yaml"],
        ["replay", "trace.jsonl", "--config", "no-such.yaml"],
        ["replay", "trace.jsonl", "--compare", "good.yaml", "no-such.yaml"],
        ["simulate", "trace.jsonl", "--config", "no-such.yaml"],
        ["simulate", "trace.jsonl", "--curve", "--config", "no-such.yaml"],
    ],
}


@pytest.mark.parametrize(
    ("status", "argv"),
    [(status, argv) for status, cases in CASES.items() for argv in cases],
    ids=lambda v: str(v) if isinstance(v, int) else " ".join(v),
)
def test_each_documented_exit_status_holds(
    files: Path,
    status: int,
    argv: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(files)
    for name in [k for k in os.environ if k.startswith("TIERD_")]:
        monkeypatch.delenv(name)
    try:
        returned = main(argv)
    except SystemExit as exit:  # argparse's usage errors
        returned = int(exit.code or 0)
    err = capsys.readouterr().err
    assert returned == status, err
    assert "Traceback" not in err
    if status:
        assert err.strip(), "a failure says why"


def test_a_daemon_without_its_config_exits_78_for_systemd(files: Path) -> None:
    done = tierd("serve", "-c", "no-such.yaml", cwd=files)
    assert done.returncode == 78, done.stderr
    assert "no-such.yaml" in done.stderr and "Traceback" not in done.stderr


def test_the_readme_documents_exactly_these_statuses() -> None:
    readme = (ROOT / "README.md").read_text()
    paragraph = readme[readme.index("Exit status: 0 ok") :].split("\n\n")[0]
    documented = {int(n) for n in re.findall(r"(?:^|; |: )(\d+) ", " ".join(paragraph.split()))}
    assert documented == {*CASES, INTERRUPTED}
