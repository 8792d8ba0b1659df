"""What serving several block sizes costs the configured one (issue 39, item 1).

Two daemons side by side, each one CPU tier of 256 MiB at ``block_bytes`` 64 KiB:

- one size: ``block_sizes: 1`` (what every daemon ran before);
- several: ``block_sizes: 2``, its second size (16 KiB) opened by a neighbour that stored
  blocks of it and stays connected.

On each, a client of the configured size does, per repetition, ``--lookups`` lookups of
32 stored keys (one round trip each) and a store and load of 64 blocks through its pool.
Each figure is the median of ``--reps`` interleaved repetitions (order rotating), with
the spread; the ratio is several/one (1.0: no cost). The markdown goes to
docs/bench/block_sizes.md. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import uvloop

from bench.figures import Figure, ratio, side_by_side_async
from bench.fragment import default_out, write_fragment
from tierd.client import Client
from tierd.testing import daemon_config, start_daemon

BLOCK = 64 << 10
OTHER = 16 << 10
KEYS = [f"key-{i}".encode() for i in range(32)]
ROWS = [f"row-{i}".encode() for i in range(64)]


async def _client(path: str, size: int, namespace: str = "bench") -> Client:
    return await Client.connect(path, namespace=namespace, block_bytes=size)


def _lookups(client: Client, count: int) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        for _ in range(count):
            await client.lookup(KEYS)

    return run


def _moves(client: Client) -> Callable[[], Awaitable[None]]:
    data = [bytes([i % 251]) * BLOCK for i in range(len(ROWS))]

    async def run() -> None:
        await client.store(ROWS, data)
        await client.load(ROWS)
        await client.delete(keys=ROWS)

    return run


async def measure(args: argparse.Namespace, root: Path) -> dict[str, tuple[Figure, Figure]]:
    procs = []
    clients: list[Client] = []
    try:
        mine: dict[int, Client] = {}
        for classes in (1, 2):
            where = root / f"sizes-{classes}"
            where.mkdir()
            config = daemon_config(
                where, cpu_blocks=4096, disk_blocks=None, block_bytes=BLOCK, block_sizes=classes
            )
            config["tiers"][0]["capacity"] = "256MiB"
            config["logging"] = {"level": "warning"}
            proc = start_daemon(config, log=where / "tierd.log")
            procs.append(proc)
            client = await _client(str(config["socket"]["path"]), BLOCK)
            clients.append(client)
            await client.store(KEYS, [b"k" * BLOCK] * len(KEYS))
            if classes > 1:  # the neighbour of another size, connected throughout
                other = await _client(str(config["socket"]["path"]), OTHER, "neighbour")
                clients.append(other)
                await other.store(ROWS, [b"o" * OTHER] * len(ROWS))
            mine[classes] = client
        lookups = await side_by_side_async(
            args.reps, _lookups(mine[2], args.lookups), _lookups(mine[1], args.lookups)
        )
        moves = await side_by_side_async(args.reps, _moves(mine[2]), _moves(mine[1]))
    finally:
        for client in clients:
            await client.close()
        for proc in procs:
            proc.stop()
    per_lookup = [Figure([s / args.lookups for s in f.runs]) for f in lookups]
    return {"lookup": (per_lookup[0], per_lookup[1]), "moves": (moves[0], moves[1])}


def report(figures: dict[str, tuple[Figure, Figure]], args: argparse.Namespace) -> str:
    lines = [
        "| figure | block_sizes: 1 | block_sizes: 2 (a second size in use) | ratio |",
        "|---|---|---|---|",
    ]
    rows = {
        "lookup": ("lookup of 32 keys, one round trip (us)", 1e6),
        "moves": ("store + load + delete of 64 x 64 KiB through the pool (ms)", 1e3),
    }
    for name, (label, scale) in rows.items():
        several, one = figures[name]
        lines.append(
            f"| {label} | {one.text(scale, 1)} | {several.text(scale, 1)} |"
            f" {ratio(several.median, one.median):.3f} |"
        )
    head = (
        f"Medians of {args.reps} interleaved repetitions ({args.lookups} lookups each),"
        f" spread min-max; {os.cpu_count()} cores.\n\n"
    )
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--lookups", type=int, default=500)
    parser.add_argument("--out", type=Path, default=default_out("block_sizes"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tierd-bench-") as root:
        figures = uvloop.run(measure(args, Path(root)))
    write_fragment(report(figures, args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
