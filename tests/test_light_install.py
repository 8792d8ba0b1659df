"""torch is the GPU extra's (``pip install 'tierd[gpu]'``): the command line, the client,
the daemon and the CPU, disk and remote tiers never import it, and a config with a GPU
tier on a machine without torch says what to install.

"Without torch" is made real in a child process: ``sys.modules["torch"] = None`` makes
every ``import torch`` fail and ``importlib.util.find_spec("torch")`` answer ``None``, as
on an install without the extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

from tierd.testing.daemon import daemon_config

ROOT = Path(__file__).resolve().parent.parent
NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def _python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_the_cli_the_client_and_the_daemon_do_not_import_torch() -> None:
    code = textwrap.dedent("""
        import json, sys
        import tierd, tierd.cli, tierd.client, tierd.daemon, tierd.library, tierd.stores
        import tierd.stores.cuda
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        print(json.dumps(loaded))
    """)
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_a_cpu_and_disk_chain_runs_without_torch(tmp_path: Path) -> None:
    """A whole daemon without torch: it starts, a client stores through the pool and
    loads back from both tiers, and it stops cleanly."""
    config = tmp_path / "tierd.yaml"
    config.write_text(yaml.safe_dump(daemon_config(tmp_path, cpu_blocks=4, disk_blocks=16)))
    code = NO_TORCH + textwrap.dedent("""
        import asyncio, sys
        from tierd.client import Client
        from tierd.daemon import Daemon
        from tierd.settings import load_settings

        async def main() -> None:
            cfg = load_settings(sys.argv[1])
            keys = [bytes([i]) * 8 for i in range(8)]
            blocks = [bytes([i]) * cfg.block_bytes for i in range(8)]
            daemon = Daemon(cfg, handle_signals=False)
            task = asyncio.create_task(daemon.run())
            await daemon.ready.wait()
            async with await Client.connect(str(cfg.socket.path), namespace="t") as c:
                assert c.pool is not None
                for part in (slice(0, 4), slice(4, 8)):  # the pool holds 4
                    async with c.storing(keys[part]) as lease:
                        for slot, data in zip(lease.slots, blocks[part]):
                            c.pool.view(slot)[:] = data
                # 4 from the disk tier (promoted through the pool), 4 from the pool
                got = await c.load(keys[:4]) + await c.load(keys[4:])
                assert got == blocks, "wrong bytes"
            daemon.request_stop()
            assert await task == 0
            print("ok", "torch" in sys.modules and sys.modules["torch"] is not None)

        asyncio.run(main())
    """)
    done = _python(code, str(config))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].split() == ["ok", "False"]


def test_a_gpu_tier_without_torch_says_what_to_install(tmp_path: Path) -> None:
    config = daemon_config(tmp_path)
    config["tiers"].insert(0, {"name": "gpu", "kind": "gpu", "capacity": 4, "device": "cpu"})
    config["entry"] = "cpu"
    path = tmp_path / "tierd.yaml"
    path.write_text(yaml.safe_dump(config))
    code = NO_TORCH + "from tierd.cli import main; sys.exit(main())"
    done = _python(code, "serve", "-c", str(path))
    assert done.returncode != 0
    assert "pip install 'tierd[gpu]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_without_a_config_runs_the_shipped_default_chain(tmp_path: Path) -> None:
    """``tierd serve`` with no ``-c`` and no ``$TIERD_CONFIG`` runs the shipped tierd.yaml
    (a CPU pool over a disk tier in the XDG state directory), without torch."""
    import asyncio

    from tierd.client import Client
    from tierd.testing import short_socket_path, start_daemon

    path = short_socket_path()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
    env.update(
        PYTHONPATH=str(ROOT),
        XDG_STATE_HOME=str(tmp_path / "state"),
        TIERD_SOCKET__PATH=path,
        TIERD_TIERS__0__CAPACITY="8MiB",  # small sizes for a test; the rest as shipped
        TIERD_TIERS__1__CAPACITY="16MiB",
    )
    code = NO_TORCH + "from tierd.cli import main; sys.exit(main())"
    command = [sys.executable, "-c", code, "serve"]
    with start_daemon(command=command, env=env, log=tmp_path / "serve.log") as child:
        *progress, ready = child.notices
        assert ready == b"READY=1"
        assert all(m.startswith(b"EXTEND_TIMEOUT_USEC=") for m in progress), progress

        async def tiers() -> list[str]:
            async with await Client.connect(path) as client:
                stats = await client.stats()
            return [tier["name"] for tier in stats["tiers"]]

        assert asyncio.run(tiers()) == ["cpu", "disk"]
        status = child.stop(60)
    err = child.log_text()
    assert status == 0, err
    assert "running the default" in err and "tierd/share/tierd.yaml" in err
    assert (tmp_path / "state" / "tierd" / "disk").is_dir()


def test_a_client_command_imports_only_its_own_family() -> None:
    """``tierd stats`` (a monitoring script's scrape) loads the client and its own command
    module, not the config models, numpy, the stores or the other commands' modules."""
    code = textwrap.dedent("""
        import json, sys
        from tierd.cli import build_parser
        build_parser("stats").parse_args(["stats", "--json"])
        heavy = ("pydantic", "numpy", "torch", "tierd.stores", "tierd.config",
                 "tierd.cli.replay_cmd", "tierd.cli.offline", "tierd.cli.config_cmd")
        print(json.dumps(sorted(m for m in heavy if m in sys.modules)))
    """)
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_every_family_names_exactly_its_commands() -> None:
    """The lazy tables of the command line and each family module's ``COMMANDS`` agree, so
    no command goes missing from ``tierd --help`` or from its own invocation, and ``tierd
    --help`` says of each what its module says."""
    from tierd.cli import FAMILY_OF, SUMMARY_OF, commands

    for name, family in FAMILY_OF.items():
        assert name in commands(name), f"{family} does not define {name}"
        assert set(commands(name)) == {n for n, f in FAMILY_OF.items() if f == family}
    assert list(commands()) == list(FAMILY_OF)
    assert {name: command.help for name, command in commands().items()} == SUMMARY_OF
    assert list(SUMMARY_OF) == list(FAMILY_OF)
