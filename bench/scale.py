"""How tierd's costs grow with scale: ``scripts/bench scale PART [options]``.

Parts (each prints a markdown table and writes its figures as JSON under ``--out``):

- ``restart``: a real daemon over a disk tier of ``--blocks`` blocks, restarted after a
  clean stop and after a SIGKILL: time to READY and to the first block served, blocks
  lost (:mod:`bench_scale_restart`).
- ``disk``, ``keys``, ``clients``, ``pool``: how each cost grows (``--sizes``; see
  :mod:`bench_scale_growth`).

Run the previous release's figures by pointing ``PYTHONPATH`` at its source tree: the
parts use only the library, the client and ``tierd serve``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import bench.scale_growth as growth
import bench.scale_restart as bench_scale_restart


def restart_table(res: dict[str, Any]) -> str:
    rows = [
        "| start | disk tier open s | READY s | first block served s | all adopted s"
        " | daemon CPU s to READY | read syscalls | MiB read | RSS MiB | blocks lost"
        " | bad reads |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, key in (
        ("100 blocks (what every start costs)", "empty_tier"),
        ("after a clean stop", "after_clean_close"),
        ("after a SIGKILL under load", "after_sigkill"),
        ("after a SIGTERM", "after_sigterm"),
    ):
        r = res[key]
        lost = r["lost"] if key != "empty_tier" else "-"
        rows.append(
            f"| {label} | {r['disk_open_s']} | {r['ready_s']} | {r['first_block_s']} |"
            f" {r.get('all_adopted_s', '-')} | {r['cpu_s']} |"
            f" {r['read_syscalls']:,} | {r['read_mib']} | {r['rss_mib']} | {lost} |"
            f" {r['bad']} |"
        )
    return "\n".join(rows)


_DEFAULT_SIZES = {
    "disk": "10000,100000,1000000,4000000",
    "keys": "1,4,16,64,256,1024,4096",
    "clients": "1,2,4,8,16,32,64",
    "pool": "256MiB,1GiB,4GiB,8GiB",
}


def grow(part: str, work: Path, sizes: str) -> list[dict[str, Any]]:
    given = (sizes or _DEFAULT_SIZES[part]).split(",")
    if part == "disk":
        return growth.disk_growth(work / "disk", [int(s) for s in given])
    if part == "keys":
        return growth.keys_growth(work / "keys", [int(s) for s in given])
    if part == "clients":
        return growth.clients_growth(work / "clients", [int(s) for s in given])
    return growth.pool_growth(work / "pool", given)


def plot(out: Path, target: Path) -> Path:
    """Draw the growth parts found in ``out`` (their JSON files) into ``target`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    if (out / "disk.json").exists():
        rows = json.loads((out / "disk.json").read_text())["rows"]
        n = [r["blocks"] for r in rows]
        for key, label in (("clean", "clean open"), ("crash", "crash open")):
            axes[0].plot(
                n,
                [r[key]["open_cpu_s"] / r["blocks"] * 1e6 for r in rows],
                "o-",
                label=f"{label}: CPU us per block",
            )
        axes[0].plot(
            n,
            [r["clean"]["bytes_per_block"] / 100 for r in rows],
            "s--",
            label="RSS per block / 100 (bytes)",
        )
        axes[0].set(xscale="log", xlabel="blocks in the disk tier", title="disk tier index")
        axes[0].legend(fontsize=8)
    if (out / "keys.json").exists():
        rows = json.loads((out / "keys.json").read_text())["rows"]
        axes[1].plot([r["keys"] for r in rows], [r["p50_us"] for r in rows], "o-")
        axes[1].set(
            xscale="log",
            yscale="log",
            xlabel="keys per lookup",
            ylabel="p50 round trip (us)",
            title="keys per lookup",
        )
    if (out / "clients.json").exists():
        rows = json.loads((out / "clients.json").read_text())["rows"]
        c = [r["clients"] for r in rows]
        axes[2].plot(
            c,
            [r["daemon_cpu_us_per_request"] for r in rows],
            "o-",
            label="daemon CPU per request (us)",
        )
        axes[2].plot(c, [r["p50_ms"] * 100 for r in rows], "s--", label="p50 step x 100 (ms)")
        axes[2].set(xscale="log", xlabel="engine-like connections", title="clients")
        axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=90)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["restart", "disk", "keys", "clients", "pool", "plot"])
    parser.add_argument("--sizes", default="", help="comma-separated sizes of the part")
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (a disk)")
    parser.add_argument("--out", type=Path, default=Path("bench-scale"))
    parser.add_argument("--label", default="", help="added to the JSON file's name")
    args = parser.parse_args(argv)
    if args.part == "plot":
        print(plot(args.out, args.out / "scale.png"))
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="tierd-scale-", dir="/var/tmp"))
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        if args.part == "restart":
            res = bench_scale_restart.run_restarts(work / "restart", args.blocks)
            print(restart_table(res))
        else:
            res = {"env": growth.environment(), "rows": grow(args.part, work, args.sizes)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    name = f"{args.part}{'-' + args.label if args.label else ''}.json"
    (args.out / name).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
