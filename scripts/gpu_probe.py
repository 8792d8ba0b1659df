#!/usr/bin/env python
"""The checks a first run on a GPU must make, in order (scripts/gpu_probe runs this).

No line of the GPU tier has run on a GPU before this script: each step checks one thing
that could only be reasoned about on a machine without one (docs/gpu.md lists them).

1. the CUDA test suite (``pytest -m cuda``);
2. a copy whose slots cross two host registrations of a pinned pool (CUDA wants one
   registration per host range of a copy): first raw, to see what CUDA does with it, then
   through the transfer engine, which cuts such runs;
3. a forced failed ``cudaHostRegister`` followed by an unrelated kernel launch on the
   same thread (the failure's "last error" must have been cleared);
4. the time to allocate and register a CPU pool of 16, 64 and 128 GiB, where memory allows;
5. a write of GPU rows produced on a side stream, then the chain's write-through to the
   CPU tier: the bytes that arrive are the ones the side stream wrote;
6. the I/O benchmark (scripts/bench io) at 2 GiB per repetition;
7. with two GPUs or more: a GPU tier on cuda:1 (with a pinned CPU tier) makes no CUDA
   context on GPU 0.

Each step's result goes to ``OUT/probe.json`` and a markdown table to ``OUT/probe.md``
(for docs/BENCHMARKS.md). Without torch or a CUDA device it says why and exits 0,
having run nothing. A probe, not a test: it asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
Result = dict[str, Any]


def no_gpu_reason() -> str | None:
    from tierd.stores.cuda import cuda_unavailable_reason

    return cuda_unavailable_reason()


def step_cuda_suite() -> Result:
    done = subprocess.run(
        # A module that cannot be imported where the probe runs (a dev-only dependency,
        # say) is reported in the summary; the CUDA tests of every other module still run.
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "cuda",
            "-p",
            "no:cacheprovider",
            "--continue-on-collection-errors",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    tail = done.stdout.strip().splitlines()[-1:] or [done.stderr.strip()[-300:]]
    return {"ok": done.returncode == 0, "summary": tail[0]}


def step_cross_registration() -> Result:
    import torch

    from tierd.keys import int_key
    from tierd.stores.cpu import CpuStore
    from tierd.stores.gpu import GpuStore
    from tierd.transfer import TransferEngine

    block = 2 << 20
    result: Result = {}
    cpu = CpuStore(num_blocks=16, block_bytes=block, register_chunk_bytes=4 * block)
    gpu = GpuStore(num_blocks=16, block_bytes=block, device="cuda")

    async def run() -> None:
        async with cpu, gpu, TransferEngine() as engine:
            result["pinned"] = cpu.stats().details.get("pinned")
            rows = cpu.pool_tensor()
            rows[2:10] = torch.arange(8, dtype=torch.uint8).repeat_interleave(block).view(8, -1)
            try:  # raw: one copy across the registration edge at slot 4
                raw = rows[2:10].to("cuda", non_blocking=True)
                torch.cuda.synchronize()
                result["raw_copy"] = "ok" if torch.equal(raw.cpu(), rows[2:10]) else "WRONG BYTES"
            except RuntimeError as exc:
                result["raw_copy"] = f"error: {exc}"
            keys = [int_key(i) for i in range(8)]
            sent = rows[2:10].clone()  # slots 8 and 9 are written back over below
            ok = await engine.copy(cpu, range(2, 10), gpu, range(8), keys)
            back = await engine.copy(gpu, range(8), cpu, range(8, 16), keys)
            same = torch.equal(rows[8:16], sent)
            result["engine_copy"] = (
                "ok"
                if all(ok) and all(back) and same
                else f"FAILED (to gpu {sum(ok)}/8, back {sum(back)}/8, bytes equal {same})"
            )

    asyncio.run(run())
    result["ok"] = result.get("engine_copy") == "ok"
    return result


def step_failed_registration_then_launch() -> Result:
    import mmap

    import torch

    from tierd.stores.cuda import CudaCallError, _cudart, host_register, host_unregister

    buffer = mmap.mmap(-1, 4 << 20)
    address = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    torch.ones(1, device="cuda")  # a context first, as in the daemon
    chunks = host_register(address, 4 << 20, chunk_bytes=4 << 20)
    result: Result = {}
    try:
        # Registering the same range again fails (already registered).
        host_register(address, 4 << 20, chunk_bytes=4 << 20)
        result["second_register"] = "unexpectedly succeeded"
    except CudaCallError as exc:
        result["second_register"] = str(exc)
    try:
        value = (torch.ones(1024, device="cuda") * 2).sum().item()
        result["launch_after"] = "ok" if value == 2048 else f"wrong value {value}"
    except RuntimeError as exc:
        result["launch_after"] = f"error: {exc}"
    # The finding itself, without tierd's clearing: a raw failed call, then a launch.
    code = int(_cudart().cudaHostRegister(address, 4 << 20, 1))
    try:
        torch.ones(8, device="cuda").add_(1)
        torch.cuda.synchronize()
        result["raw_launch_after_failure"] = f"ok (register code {code})"
    except RuntimeError as exc:
        result["raw_launch_after_failure"] = f"error: {exc}"
    host_unregister(chunks)
    result["ok"] = result["launch_after"] == "ok"
    return result


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def step_registration_time() -> Result:
    from tierd.stores.cpu import CpuStore

    result: Result = {}
    for gib in (16, 64, 128):
        if gib * GIB > _available_bytes() * 0.8:
            result[f"{gib}GiB"] = "skipped: not enough free memory"
            continue
        stages: dict[str, float] = {}
        started = time.perf_counter()

        def progress(
            stage: str,
            done: int,
            total: int,
            _stages: dict[str, float] = stages,
            _started: float = started,
        ) -> None:
            _stages[stage] = time.perf_counter() - _started

        store = CpuStore(
            num_blocks=gib * 512, block_bytes=2 << 20, memfd=True, pin_device=0, progress=progress
        )

        async def run(store: CpuStore = store) -> dict[str, Any]:
            async with store:
                return dict(store.stats().details)

        details = asyncio.run(run())
        result[f"{gib}GiB"] = {
            "allocate_s": round(stages.get("allocating", 0.0), 2),
            "allocate_and_pin_s": round(stages.get("pinning", 0.0), 2),
            "register_s": round(details.get("register_seconds", 0.0), 2),
            "pinned": details.get("pinned"),
        }
    result["ok"] = True
    return result


def step_side_stream_write_through(tmp: Path) -> Result:
    import torch

    from tierd.library import open_chain

    block = 2 << 20
    config = {
        "block_bytes": block,
        "entry": "gpu",
        "tiers": [
            {"name": "gpu", "kind": "gpu", "capacity": 64, "device": "cuda", "write_through": True},
            {"name": "cpu", "kind": "cpu", "capacity": 64},
        ],
    }
    result: Result = {}

    async def run() -> None:
        async with open_chain(config) as chain:
            side = torch.cuda.Stream()
            keys = [f"side-{i}".encode() for i in range(32)]
            with torch.cuda.stream(side):
                rows = torch.zeros((32, block), dtype=torch.uint8, device="cuda")
                for _ in range(50):  # slow enough that a copy not waiting would see zeros
                    rows.add_(1)
                await chain.store(keys, list(rows))
            await chain.flush()  # whatever write-through has not finished yet
            cpu_level = chain.levels[1]
            held = [cpu_level.tier.lookup([k]) for k in keys]
            result["cpu_tier_holds"] = sum(held)
            async with chain.loading(keys, into="cpu") as handle:
                views = handle.views()
                good = all(bytes(memoryview(v).cast("B")[:4]) == b"\x32" * 4 for v in views)
            result["bytes"] = "ok" if good else "STALE (zeros or partial)"

    try:
        asyncio.run(run())
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["ok"] = result.get("bytes") == "ok"
    return result


def step_io_bench(out: Path) -> Result:
    target = out / "io.md"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.io",
            "--mib",
            "2048",
            "--out",
            str(target),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    return {"ok": done.returncode == 0, "markdown": str(target), "tail": done.stderr[-400:]}


_CUDA1_CHILD = """
import asyncio, os, sys
from tierd.library import open_chain
cfg = {"block_bytes": 2 << 20, "entry": "gpu", "tiers": [
    {"name": "gpu", "kind": "gpu", "capacity": 16, "device": "cuda:1", "write_through": True},
    {"name": "cpu", "kind": "cpu", "capacity": 16}]}
async def main():
    async with open_chain(cfg) as chain:
        import torch
        rows = torch.ones((8, 2 << 20), dtype=torch.uint8, device="cuda:1")
        await chain.store([b"k%d" % i for i in range(8)], list(rows))
        print("ready", flush=True)
        sys.stdin.readline()
asyncio.run(main())
"""


def step_no_context_on_gpu0() -> Result:
    import torch

    if torch.cuda.device_count() < 2:
        return {"ok": True, "skipped": f"{torch.cuda.device_count()} GPU(s): needs two"}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", _CUDA1_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline().strip()
        query = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        buses = [
            row.split(",")[1].strip()
            for row in query.splitlines()
            if row.split(",")[0].strip() == str(child.pid)
        ]
        child.stdin.write("\n")
        child.stdin.flush()
    finally:
        child.wait(timeout=60)
    gpu0 = torch.cuda.get_device_properties(0)
    bus0 = f"{getattr(gpu0, 'pci_bus_id', '?')}"
    return {
        "ok": line == "ready" and len(buses) == 1,
        "child": line,
        "contexts_on": buses,
        "gpu0_bus": bus0,
    }


STEPS: list[tuple[str, Callable[..., Result]]] = [
    ("cuda_suite", step_cuda_suite),
    ("cross_registration_copy", step_cross_registration),
    ("failed_registration_then_launch", step_failed_registration_then_launch),
    ("registration_time", step_registration_time),
    ("side_stream_write_through", step_side_stream_write_through),
    ("io_bench_2GiB", step_io_bench),
    ("no_context_on_gpu0", step_no_context_on_gpu0),
]


def markdown(results: dict[str, Result], machine: dict[str, str]) -> str:
    lines = [
        "## GPU probe",
        "",
        f"{machine['gpu']}, torch {machine['torch']}, CUDA {machine['cuda']}, {machine['date']}",
        "",
        "| step | ok | result |",
        "|---|---|---|",
    ]
    for name, result in results.items():
        rest = {k: v for k, v in result.items() if k != "ok"}
        lines.append(f"| {name} | {'yes' if result.get('ok') else 'NO'} | `{json.dumps(rest)}` |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(f"/tmp/tierd-gpu-probe-{os.getpid()}"))
    parser.add_argument("--only", action="append", help="run only this step (repeatable)")
    args = parser.parse_args()
    reason = no_gpu_reason()
    if reason is not None:
        print(f"gpu_probe: nothing run, no GPU to probe: {reason}")
        return 0
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    machine = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    results: dict[str, Result] = {}
    for name, step in STEPS:
        if args.only and name not in args.only:
            continue
        print(f"gpu_probe: {name} ...", flush=True)
        started = time.perf_counter()
        try:
            needs_out = name in ("side_stream_write_through", "io_bench_2GiB")
            result = step(args.out) if needs_out else step()
        except Exception as exc:  # one step's failure is a finding; the next steps still run
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.perf_counter() - started, 1)
        results[name] = result
        print(f"gpu_probe: {name}: {json.dumps(result)}", flush=True)
        (args.out / "probe.json").write_text(
            json.dumps({"machine": machine, "steps": results}, indent=2)
        )
        (args.out / "probe.md").write_text(markdown(results, machine))
    print(f"gpu_probe: results in {args.out}/probe.json and probe.md")
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
