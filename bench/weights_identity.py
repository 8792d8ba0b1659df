#!/usr/bin/env python
"""What the vLLM tier's weights identity costs at start-up (issue 35, point 3).

``tierd.integrations.core.naming.weights_identity`` reads, per weight file, its header and a
fixed number of small slices (:func:`~tierd.integrations.core.naming._sample_ranges`), so its
cost should not grow with the file's size. This builds a model directory of one
safetensors-shaped file per size asked (sparse: a header, then holes), and, with
``--written``, one file of real bytes whose pages are dropped from the page cache
(``posix_fadvise(DONTNEED)``) before every run, so its reads come from the disk. Each is
timed against a ``stat`` of the same files (the old identity) in the same run; medians
of ``--runs`` runs. Nothing is left behind.

    scripts/bench weights_identity [--sizes-gib 1 8 64] [--written-gib 1]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench.figures import median_of
from tierd.integrations.core.naming import weights_identity


def safetensors(path: Path, size: int, *, written: bool) -> None:
    header = json.dumps({"w": {"dtype": "BF16", "shape": [size // 2], "data_offsets": [0, 0]}})
    raw = header.encode()
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        if written:
            chunk = os.urandom(8 << 20)
            while f.tell() + len(chunk) <= size:
                f.write(chunk)
        f.truncate(size)


def drop_cache(directory: Path) -> None:
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(call, runs: int, before=None) -> float:
    samples = []
    for _ in range(runs):
        if before is not None:
            before()
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return median_of(samples)


def measure(directory: Path, runs: int, cold: bool) -> tuple[float, float]:
    """(identity s, stat-only s) for the model directory."""
    before = (lambda: drop_cache(directory)) if cold else None
    identity = timed(lambda: weights_identity(str(directory)), runs, before)
    stats = timed(lambda: [p.stat() for p in directory.iterdir()], runs, before)
    return identity, stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-gib", type=float, nargs="+", default=[1, 8, 64])
    parser.add_argument("--written-gib", type=float, default=0)
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args(argv)
    cases = [(gib, False) for gib in args.sizes_gib]
    if args.written_gib:
        cases.append((args.written_gib, True))
    print("| file | identity (ms) | stat only (ms) | ratio |")
    print("|---|---:|---:|---:|")
    for gib, written in cases:
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", ".")) as tmp:
            directory = Path(tmp) / "model"
            directory.mkdir()
            safetensors(directory / "model.safetensors", int(gib * (1 << 30)), written=written)
            (directory / "config.json").write_text("{}")
            identity, stats = measure(directory, args.runs, cold=written)
        kind = "written, cold cache" if written else "sparse"
        ratio = identity / stats if stats else float("inf")
        print(f"| {gib:g} GiB {kind} | {identity * 1e3:.2f} | {stats * 1e3:.3f} | {ratio:.0f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
