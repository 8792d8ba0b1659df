"""``lmcache bench l2`` figures for tierd's L2 adapter against LMCache's own ``fs`` adapter
and its RESP adapter on a real redis-server, in one run.

Runs under .venv's python; LMCache runs in .venv-lmcache (scripts/setup_lmcache)::

    scripts/bench lmcache [--rounds 5] [--num-keys 32] [--data-size-kb 256]

Every case is LMCache's own ``lmcache bench l2`` (store, lookup-and-lock, load, with
``--no-skip-verify``: the last round's loaded bytes are compared with the stored ones), on
a fresh store: tierd as a real ``tierd serve`` with a CPU tier that holds every object
("cpu tier"), and with a CPU tier of one round's objects over a disk tier in a temporary
directory, so that earlier rounds' objects are demoted to disk ("disk tier"); LMCache's
``fs`` adapter in a temporary directory (the same file system); LMCache's ``resp`` adapter
(its compiled client) on a redis-server on loopback without persistence. Figures go to
docs/BENCHMARKS.md by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from redis_kit import RedisServer  # noqa: E402

from tierd.testing import DaemonProcess, daemon_config, start_daemon  # noqa: E402

LMCACHE_PYTHON = Path(
    os.environ.get("TIERD_LMCACHE_PYTHON", ROOT / ".venv-lmcache" / "bin" / "python")
)
TIERD = ROOT / ".venv" / "bin" / "tierd"
READY_S = 60.0


def tierd_spec(socket_path: str) -> dict[str, Any]:
    return {
        "type": "plugin",
        "module_path": "tierd.integrations.lmcache",
        "class_name": "TierdL2Adapter",
        "adapter_params": {"socket": socket_path},
    }


def start_tierd(
    workdir: Path, block: int, cpu_blocks: int, disk_blocks: int | None
) -> tuple[DaemonProcess, str]:
    """``tierd serve`` (.venv's console script) of a small chain, once it sent READY=1."""
    config = daemon_config(
        workdir, block_bytes=block, cpu_blocks=cpu_blocks, disk_blocks=disk_blocks
    )
    command = [str(TIERD), "serve", "-c", str(workdir / "tierd.yaml")]
    (workdir / "tierd.yaml").write_text(yaml.safe_dump(config))
    socket_path = str(config["socket"]["path"])
    # Not this script's TIERD_LMCACHE_PYTHON: the daemon refuses TIERD_* it does not know.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
    log = workdir / "tierd.log"
    daemon = start_daemon(
        command=command, env=env, log=log, socket_path=socket_path, timeout_s=READY_S
    )
    return daemon, socket_path


def bench(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One ``lmcache bench l2`` run; its operations by name, with ``verified``."""
    command = [str(LMCACHE_PYTHON), "-m", "lmcache.cli.main", "bench", "l2"]
    command += ["--l2-adapter", json.dumps(spec), "--no-skip-verify"]
    command += ["--lookup-max-hit-rate", "1.0", "--format", "json"]
    command += ["--rounds", str(args.rounds), "--num-keys", str(args.num_keys)]
    command += ["--data-size-kb", str(args.data_size_kb), "--in-flight", str(args.in_flight)]
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd="/")
    out = done.stdout
    start = out.find("\n{")
    if done.returncode != 0 or start < 0:
        raise RuntimeError(f"lmcache bench l2 failed ({done.returncode}):\n{out}{done.stderr}")
    report = json.JSONDecoder().raw_decode(out[start + 1 :])[0]["metrics"]
    ops = {op["operation"]: op for key, op in report.items() if key.startswith("op_")}
    return {"ops": ops, "verified": "data verified OK" in out}


def run_case(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    block = args.data_size_kb * 1024
    per_round = args.num_keys * args.in_flight
    total = per_round * (args.rounds + 1)  # warm-up round included
    if name.startswith("tierd"):
        cpu = 2 * total if name == "tierd cpu tier" else per_round
        disk = None if name == "tierd cpu tier" else 2 * total
        proc, socket_path = start_tierd(workdir, block, cpu, disk)
        try:
            return bench(tierd_spec(socket_path), args)
        finally:
            proc.stop()
    if name == "LMCache fs":
        return bench({"type": "fs", "base_path": str(workdir / "fs")}, args)
    redis = RedisServer(workdir / "redis").start()
    try:
        return bench({"type": "resp", "host": "127.0.0.1", "port": redis.port}, args)
    finally:
        redis.stop()


CASES = ("tierd cpu tier", "tierd disk tier", "LMCache fs", "LMCache resp (redis-server)")


def table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    head = (
        f"| {args.num_keys} objects of {args.data_size_kb} KiB per task, mean of "
        f"{args.rounds} rounds | store MB/s | lookup-and-lock ms (median) | load MB/s | "
        "load vs fs | verified |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---|"]
    fs_load = results["LMCache fs"]["ops"]["Load"]["throughput_avg_mbps"]
    for name, result in results.items():
        ops = result["ops"]
        load = ops["Load"]["throughput_avg_mbps"]
        ratio = load / fs_load if fs_load else float("nan")
        lines.append(
            f"| {name} | {ops['Store']['throughput_avg_mbps']:.0f} | "
            f"{ops['Lookup']['duration_p50_ms']:.2f} | {load:.0f} | {ratio:.2f} | "
            f"{'yes' if result['verified'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-keys", type=int, default=32)
    parser.add_argument("--data-size-kb", type=int, default=256)
    parser.add_argument("--in-flight", type=int, default=1)
    args = parser.parse_args(argv)
    if not LMCACHE_PYTHON.is_file():
        sys.exit(f"LMCache is not installed ({LMCACHE_PYTHON} missing): run scripts/setup_lmcache")
    results: dict[str, dict[str, Any]] = {}
    for name in CASES:
        with tempfile.TemporaryDirectory(prefix="bench-lmcache-") as tmp:
            results[name] = run_case(name, args, Path(tmp))
        print(f"{name}: done", file=sys.stderr)
    print(table(results, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
